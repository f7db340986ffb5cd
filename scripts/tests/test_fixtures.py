"""Checks the generated fixtures, the vocabularies and the slicer against the gguf package and Hugging Face tokenizers."""
from __future__ import annotations

import heapq
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from tokenizers import Tokenizer

from conftest import REPO
from fixturegen import models, quants, train_vocab, vocab

TINY = [(s, fmt) for s in models.TINY.values() for fmt in models.TINY_FORMATS]

# Bound on ‖dequant(quant(w)) − w‖ / ‖w‖ for normal weights; the simple K-quantizers are looser than llama.cpp's.
REL_ERR = {QT.F32: 0.0, QT.F16: 1e-3, QT.BF16: 5e-3, QT.Q8_0: 0.01, QT.Q4_0: 0.12, QT.Q4_1: 0.12,
           QT.Q5_0: 0.06, QT.Q5_1: 0.06, QT.Q2_K: 0.45, QT.Q3_K: 0.3, QT.Q4_K: 0.12, QT.Q5_K: 0.06,
           QT.Q6_K: 0.03}


def read(path: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(str(path))


def field(r: gguf.GGUFReader, key: str):
    assert key in r.fields, f"missing metadata key {key}"
    return r.fields[key].contents()


def dequant(t) -> np.ndarray:
    """A reader tensor as float32 in numpy order (GGUF dims reversed)."""
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])


@pytest.mark.parametrize("shape,fmt", TINY, ids=[f"{s.name}-{f}" for s, f in TINY])
def test_fixture_metadata_shapes_types_values(fixture_dir, shape, fmt):
    r = read(fixture_dir / f"{shape.name}-{fmt}.gguf")
    a = shape.arch
    assert field(r, "general.architecture") == a
    assert field(r, f"{a}.block_count") == shape.n_layer
    assert field(r, f"{a}.context_length") == shape.n_ctx
    assert field(r, f"{a}.embedding_length") == shape.n_embd
    assert field(r, f"{a}.feed_forward_length") == shape.n_ff
    assert field(r, f"{a}.attention.head_count") == shape.n_head
    assert field(r, f"{a}.attention.head_count_kv") == shape.n_head_kv
    assert field(r, f"{a}.rope.dimension_count") == shape.head_dim
    assert field(r, f"{a}.rope.freq_base") == pytest.approx(shape.rope_theta)
    assert field(r, f"{a}.attention.layer_norm_rms_epsilon") == pytest.approx(shape.rms_eps)
    assert field(r, "general.file_type") == int(models.FILE_TYPES[fmt])
    if a == "qwen3":
        assert field(r, f"{a}.attention.key_length") == shape.head_dim
        assert field(r, f"{a}.attention.value_length") == shape.head_dim
    else:
        assert f"{a}.attention.key_length" not in r.fields
    n_vocab = len(field(r, "tokenizer.ggml.tokens"))
    assert field(r, f"{a}.vocab_size") == n_vocab

    expected = models.tensor_shapes(shape, n_vocab)
    tensors = {t.name: t for t in r.tensors}
    assert list(tensors) == list(expected)
    assert ("output.weight" in tensors) == (not shape.tied)
    assert any(n.endswith("attn_k.bias") for n in tensors) == shape.qkv_bias
    assert any(n.endswith("attn_k_norm.weight") for n in tensors) == shape.qk_norm
    for name, dims in expected.items():
        t = tensors[name]
        assert [int(d) for d in t.shape] == list(reversed(dims)), name
        qtype = models.tensor_type(fmt, name, shape.n_layer)
        assert t.tensor_type == qtype, name
        want = models.float_weights(shape, name, dims, 1234)
        got = dequant(t)
        assert np.isfinite(got).all(), name
        if qtype == QT.F32:
            assert np.array_equal(got, want), name
        else:
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert err <= REL_ERR[qtype], f"{name} {qtype.name}: relative error {err:.4f}"


def test_kmix_follows_q4_k_m():
    s = models.TINY["tiny-llama"]
    t = lambda n: models.tensor_type("kmix", n, s.n_layer)  # noqa: E731
    assert (t("token_embd.weight"), t("output.weight")) == (QT.Q8_0, QT.Q6_K)
    assert (t("blk.1.ffn_down.weight"), t("blk.1.attn_v.weight"), t("blk.1.attn_q.weight")) == (QT.Q6_K, QT.Q5_K, QT.Q4_K)
    assert t("blk.0.attn_norm.weight") == QT.F32


def test_qwen2_k_bias_has_outliers(fixture_dir):
    r = read(fixture_dir / "tiny-qwen2-f32.gguf")
    for t in r.tensors:
        if t.name.endswith("attn_k.bias"):
            big = np.abs(dequant(t)) >= 20.0
            assert 1 <= big.sum() <= 4, t.name
        elif t.name.endswith(("attn_q.bias", "attn_v.bias")):
            assert np.abs(dequant(t)).max() < 1.0, t.name


def test_same_seed_same_bytes_other_seed_other_bytes(fixture_dir, tmp_path):
    again = tmp_path / "again"
    other = tmp_path / "other"
    subprocess.run([sys.executable, str(REPO / "scripts/gen_fixtures.py"), "--out", str(again)], check=True)
    subprocess.run([sys.executable, str(REPO / "scripts/gen_fixtures.py"), "--out", str(other), "--seed", "7"],
                   check=True)
    for s, fmt in TINY:
        name = f"{s.name}-{fmt}.gguf"
        assert (fixture_dir / name).read_bytes() == (again / name).read_bytes(), name
        assert (fixture_dir / name).read_bytes() != (other / name).read_bytes(), name


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, theta: float, neox: bool) -> np.ndarray:
    """x: [T, heads, Dh]; NORM rotates pairs (2i, 2i+1), NEOX pairs (i, i + Dh/2)."""
    T, _, dh = x.shape
    ang = np.arange(T)[:, None] * theta ** (-np.arange(0, dh, 2) / dh)[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = (x[..., :dh // 2], x[..., dh // 2:]) if neox else (x[..., 0::2], x[..., 1::2])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    return np.concatenate([ra, rb], -1) if neox else np.stack([ra, rb], -1).reshape(x.shape)


def forward_logits(path: Path, s: models.Shape, ids: list[int]) -> tuple[np.ndarray, float]:
    """A plain float64 forward pass over a fixture (sanity of the random weights, not a reference);
    returns the logits [T, V] and the largest |residual| seen."""
    r = read(path)
    w = {t.name: dequant(t).astype(np.float64) for t in r.tensors}
    T, H, Hkv, dh = len(ids), s.n_head, s.n_head_kv, s.head_dim
    x = w["token_embd.weight"][ids]
    peak = 0.0
    for i in range(s.n_layer):
        p = lambda n: w[f"blk.{i}.{n}"]  # noqa: E731
        h = rms_norm(x, p("attn_norm.weight"), s.rms_eps)
        q, k, v = h @ p("attn_q.weight").T, h @ p("attn_k.weight").T, h @ p("attn_v.weight").T
        if s.qkv_bias:
            q, k, v = q + p("attn_q.bias"), k + p("attn_k.bias"), v + p("attn_v.bias")
        q, k, v = q.reshape(T, H, dh), k.reshape(T, Hkv, dh), v.reshape(T, Hkv, dh)
        if s.qk_norm:
            q, k = rms_norm(q, p("attn_q_norm.weight"), s.rms_eps), rms_norm(k, p("attn_k_norm.weight"), s.rms_eps)
        q, k = rope(q, s.rope_theta, s.arch != "llama"), rope(k, s.rope_theta, s.arch != "llama")
        k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)
        sc = np.einsum("thd,shd->hts", q, k) / np.sqrt(dh) + np.triu(np.full((T, T), -np.inf), 1)
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", pr, v).reshape(T, H * dh) @ p("attn_output.weight").T
        h = rms_norm(x, p("ffn_norm.weight"), s.rms_eps)
        g, u = h @ p("ffn_gate.weight").T, h @ p("ffn_up.weight").T
        x = x + (g / (1 + np.exp(-g)) * u) @ p("ffn_down.weight").T
        peak = max(peak, float(np.abs(x).max()))
    head = w["token_embd.weight"] if s.tied else w["output.weight"]
    return rms_norm(x, w["output_norm.weight"], s.rms_eps) @ head.T, peak


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-tied", "tiny-qwen2", "tiny-qwen3"])
def test_activations_stay_sane(fixture_dir, name):
    logits, peak = forward_logits(fixture_dir / f"{name}-f32.gguf", models.TINY[name], list(range(300, 316)))
    assert np.isfinite(logits).all()
    assert peak < 50.0
    assert 0.5 < logits.std() < 20.0
    assert len(set(logits.argmax(-1).tolist())) > 1  # not the same token everywhere


def test_vocab_training_is_deterministic(tmp_path):
    subprocess.run([sys.executable, str(REPO / "scripts/fixturegen/train_vocab.py"), "--out", str(tmp_path)],
                   check=True)
    for f in ("qwen2_bpe.tokenizer.json", "llama_spm.tokenizer.json"):
        assert (tmp_path / f).read_bytes() == (vocab.VOCAB_DIR / f).read_bytes(), f"{f} differs from a fresh training"


def test_qwen2_vocab_metadata(fixture_dir):
    r = read(fixture_dir / "tiny-qwen2-q8_0.gguf")
    hf = Tokenizer.from_file(str(vocab.VOCAB_DIR / "qwen2_bpe.tokenizer.json"))
    tokens = field(r, "tokenizer.ggml.tokens")
    assert 1000 <= len(tokens) <= 2000
    assert tokens == [hf.id_to_token(i) for i in range(hf.get_vocab_size())]
    assert field(r, "tokenizer.ggml.model") == "gpt2" and field(r, "tokenizer.ggml.pre") == "qwen2"
    types = field(r, "tokenizer.ggml.token_type")
    specials = {i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL}
    assert {tokens[i] for i in specials} == set(train_vocab.QWEN2_SPECIALS)
    assert set(types) == {gguf.TokenType.NORMAL, gguf.TokenType.CONTROL}
    merges = field(r, "tokenizer.ggml.merges")
    assert len(merges) > 1000 and all(m.count(" ") == 1 for m in merges)
    assert tokens[field(r, "tokenizer.ggml.bos_token_id")] == "<|endoftext|>"
    assert tokens[field(r, "tokenizer.ggml.eos_token_id")] == "<|im_end|>"
    assert field(r, "tokenizer.ggml.add_bos_token") is False
    assert "<|im_start|>" in field(r, "tokenizer.chat_template")


def spm_encode(text: str, tokens: list[str], scores: list[float], add_space_prefix: bool) -> list[int]:
    """llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm): merge the adjacent pair whose join is a
    token with the best score (ties: leftmost), then byte fallback for symbols that are not tokens."""
    ids = {t: i for i, t in enumerate(tokens)}
    if add_space_prefix:
        text = " " + text
    sym = list(text.replace(" ", "\u2581"))
    prev, nxt = list(range(-1, len(sym) - 1)), list(range(1, len(sym) + 1))
    heap: list[tuple[float, int, int, int]] = []

    def bigram(left: int, right: int) -> None:
        if left < 0 or right >= len(sym):
            return
        joined = sym[left] + sym[right]
        if joined in ids:
            heapq.heappush(heap, (-scores[ids[joined]], left, right, len(joined)))

    for i in range(1, len(sym)):
        bigram(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
            continue
        sym[left], sym[right] = sym[left] + sym[right], ""
        nxt[left] = nxt[right]
        if nxt[left] < len(sym):
            prev[nxt[left]] = left
        bigram(prev[left], left)
        bigram(left, nxt[left])
    out = []
    i = 0
    while i < len(sym):
        s = sym[i]
        if s in ids:
            out.append(ids[s])
        else:
            out.extend(ids[f"<0x{b:02X}>"] for b in s.encode("utf-8"))
        i = nxt[i]
    return out


def test_llama_spm_vocab_matches_hf_bpe(fixture_dir):
    r = read(fixture_dir / "tiny-llama-q4_0.gguf")
    tokens = field(r, "tokenizer.ggml.tokens")
    scores = field(r, "tokenizer.ggml.scores")
    types = field(r, "tokenizer.ggml.token_type")
    assert field(r, "tokenizer.ggml.model") == "llama"
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert types[:3] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)]
    assert set(types[3:259]) == {gguf.TokenType.BYTE} and set(types[259:]) == {gguf.TokenType.NORMAL}
    assert len(scores) == len(tokens) and 1000 <= len(tokens) <= 2000
    assert (field(r, "tokenizer.ggml.unknown_token_id"), field(r, "tokenizer.ggml.bos_token_id"),
            field(r, "tokenizer.ggml.eos_token_id")) == (0, 1, 2)
    assert field(r, "tokenizer.ggml.add_bos_token") is True
    assert field(r, "tokenizer.ggml.add_space_prefix") is True
    assert "<|assistant|>" in field(r, "tokenizer.chat_template")

    hf = Tokenizer.from_file(str(vocab.VOCAB_DIR / "llama_spm.tokenizer.json"))
    assert tokens == [hf.id_to_token(i) for i in range(hf.get_vocab_size())]
    lines = (vocab.VOCAB_DIR / "corpus.txt").read_text(encoding="utf-8").splitlines()
    lines += ["Hello world", "  two leading spaces", "unseen: ΩЖ字 🦀 ǅ", "tabs\tand\nnewlines", "x"]
    for text in lines:
        if not text:
            continue
        want = hf.encode(text, add_special_tokens=False).ids
        assert spm_encode(text, tokens, scores, True) == want, text
    assert hf.encode("Hello").ids[0] == 1  # BOS from the post-processor, as add_bos_token says


def test_vocab_padding_for_full_shapes():
    for s in models.FULL.values():
        v = models.load_vocab(s)
        assert len(v.tokens) == len(v.types) == s.n_vocab
        assert v.types[-1] == gguf.TokenType.UNUSED
        if v.scores is not None:
            assert len(v.scores) == s.n_vocab and v.scores[-1] < min(v.scores[:-1])
        names = models.tensor_shapes(s, s.n_vocab)
        assert names["token_embd.weight"] == (s.n_vocab, s.n_embd)
        for name, dims in names.items():
            qt = models.tensor_type(models.FULL_FORMAT[s.name], name, s.n_layer)
            block = gguf.GGML_QUANT_SIZES[qt][0]
            assert dims[-1] % block == 0, name


def test_k_quantizers_round_trip_extremes():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    x[0] = 0.0
    x[1, :256] = 1e-3
    x[2] *= 1e3
    x[3] = np.abs(x[3])
    for qt in quants.K_QUANTIZERS:
        y = gguf.quants.dequantize(quants.quantize(x, qt), qt).reshape(x.shape)
        assert np.isfinite(y).all(), qt.name
        assert np.array_equal(y[0], x[0]), qt.name
        for row in range(1, 8):
            err = np.linalg.norm(y[row] - x[row]) / np.linalg.norm(x[row])
            assert err <= REL_ERR[qt], f"{qt.name} row {row}: {err:.4f}"


def test_slice_smollm2_keeps_bytes(smollm2_path, tmp_path):
    out = tmp_path / "smollm2-12.gguf"
    subprocess.run([sys.executable, str(REPO / "scripts/slice_gguf.py"), str(smollm2_path), str(out), "--layers", "12"],
                   check=True)
    a, b = read(smollm2_path), read(out)
    assert field(b, "llama.block_count") == 12
    skip = {"llama.block_count", "GGUF.tensor_count"}
    assert [k for k in b.fields] == [k for k in a.fields]
    for k in a.fields:
        if k not in skip:
            assert a.fields[k].types == b.fields[k].types and a.fields[k].contents() == b.fields[k].contents(), k
    orig = {t.name: t for t in a.tensors}
    kept = [t.name for t in a.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < 12]
    assert [t.name for t in b.tensors] == kept
    assert {"token_embd.weight", "output_norm.weight"} <= set(kept)
    for t in b.tensors:
        o = orig[t.name]
        assert t.tensor_type == o.tensor_type and list(t.shape) == list(o.shape), t.name
        assert bytes(t.data.view(np.uint8)) == bytes(o.data.view(np.uint8)), t.name
    data_bytes = sum(int(t.n_bytes) for t in b.tensors)
    assert out.stat().st_size < data_bytes + 4 * 2**20  # metadata (the vocabulary) plus alignment only


def test_slice_rejects_bad_layer_count(fixture_dir, tmp_path):
    for n in ("0", "3"):
        res = subprocess.run([sys.executable, str(REPO / "scripts/slice_gguf.py"), str(fixture_dir / "tiny-qwen2-f16.gguf"),
                              str(tmp_path / "x.gguf"), "--layers", n], capture_output=True, text=True)
        assert res.returncode == 1 and "--layers must be in 1..2" in res.stderr
        assert not (tmp_path / "x.gguf").exists()


def test_shape_with_fewer_layers(tmp_path):
    """--layers N keeps a shape's widths and writes N layers, read back by the gguf package."""
    res = subprocess.run([sys.executable, str(REPO / "scripts/gen_fixtures.py"), "--out", str(tmp_path), "--shape",
                          "smollm2-135m", "--layers", "1"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    shape = models.FULL["smollm2-135m"]
    r = read(tmp_path / f"{shape.name}-{models.FULL_FORMAT[shape.name]}-1L.gguf")
    a = shape.arch
    assert field(r, f"{a}.block_count") == 1
    assert field(r, f"{a}.embedding_length") == shape.n_embd
    assert field(r, f"{a}.feed_forward_length") == shape.n_ff
    blocks = {t.name.split(".")[1] for t in r.tensors if t.name.startswith("blk.")}
    assert blocks == {"0"}
    for bad in (["--layers", "2"], ["--shape", "smollm2-135m", "--layers", "0"]):
        res = subprocess.run([sys.executable, str(REPO / "scripts/gen_fixtures.py"), "--out", str(tmp_path / "x"), *bad],
                             capture_output=True, text=True)
        assert res.returncode == 2 and "--layers goes with --shape" in res.stderr
        assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())
