"""Model shapes, deterministic random weights and the GGUF writer for the fixtures.

Dimension letters: D n_embd, H heads, Hkv KV heads, Dh head dim, F n_ff, V vocabulary, E experts, K experts used,
Fe one expert's FFN width, Fs the shared expert's (qwen2moe).
Every float weight is drawn from its own generator seeded by (seed, family, tensor name), so the
same family gives the same float weights in every format (tiny-llama and tiny-llama-tied share
them too) and a test can regenerate any tensor's float reference with `float_weights`.
"""
from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from . import quants, vocab


@dataclass(frozen=True)
class Shape:
    name: str          # file stem: <name>-<fmt>.gguf
    family: str        # weight seed key
    arch: str          # llama | qwen2 | qwen3 | gemma3 | qwen3moe | qwen2moe
    n_layer: int
    n_embd: int        # D
    n_head: int        # H
    n_head_kv: int     # Hkv
    head_dim: int      # Dh
    n_ff: int          # F
    n_ctx: int
    rope_theta: float
    rms_eps: float
    tied: bool
    vocab: str         # qwen2_bpe | llama_spm
    n_vocab: int = 0   # 0: the vocabulary's own size, else padded to this
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int = 0     # {arch}.attention.sliding_window: gemma3's local layers (every 6th is global); on
                                # llama (tiny-mistral) written but not applied, as in llama.cpp
    logit_softcap: float = 0.0  # gemma3: final_logit_softcapping when > 0
    n_expert: int = 0           # E > 0: every layer's FFN routed to experts (qwen3moe; llama: Mixtral)
    n_expert_used: int = 0      # K
    n_ff_exp: int = 0           # Fe: expert_feed_forward_length (qwen3moe, qwen2moe); llama's experts are n_ff wide
    n_ff_shexp: int = 0         # Fs > 0: a shared expert beside the routed ones (qwen2moe)


TINY = {s.name: s for s in [
    Shape("tiny-llama", "tiny-llama", "llama", 2, 256, 4, 2, 64, 512, 256, 10000.0, 1e-5, False, "llama_spm"),
    Shape("tiny-llama-tied", "tiny-llama", "llama", 2, 256, 4, 2, 64, 512, 256, 10000.0, 1e-5, True, "llama_spm"),
    Shape("tiny-qwen2", "tiny-qwen2", "qwen2", 2, 256, 8, 2, 32, 512, 256, 1e6, 1e-6, True, "qwen2_bpe",
          qkv_bias=True),
    Shape("tiny-qwen3", "tiny-qwen3", "qwen3", 2, 256, 8, 4, 32, 512, 256, 1e6, 1e-6, True, "qwen2_bpe",
          qk_norm=True),
]}

# Architectures beyond the tiny set's matrix of formats, written in a few formats only (EXTRA_FORMATS).
# tiny-gemma3: 6 layers (0-4 local, 5 global), q width 4·128 ≠ D, a window of 8 positions so a prompt
# of more than 8 tokens exercises it, and a final logit softcap (the real Gemma 3 has none).
EXTRA = {s.name: s for s in [
    Shape("tiny-gemma3", "tiny-gemma3", "gemma3", 6, 256, 4, 1, 128, 512, 256, 1e6, 1e-6, True, "llama_spm",
          qk_norm=True, sliding_window=8, logit_softcap=30.0),
]}
EXTRA_FORMATS = ["f32", "q8_0", "kmix"]

# Mixtures of experts, in F32 and Q8_0 (the router ffn_gate_inp stays F32, as llama.cpp's quantizer keeps it).
# tiny-qwen3moe: 8 experts of width 128, 2 per token; tiny-mixtral: llama with 4 experts of width n_ff (512), 2 per
# token; tiny-qwen2moe: qwen2's attention (q/k/v biases, an untied lm head as llama.cpp's qwen2moe requires), 8
# experts of width 128, 2 per token, and a shared expert of width 384 (expert_shared_feed_forward_length, not n_ff).
# The router's rows are drawn so that its logits on a normalised token have a standard deviation near
# ROUTER_LOGIT_STD: the margin between the K-th and (K+1)-th logit is then the gap of two order statistics of E
# normals, spread from ~1e-3 to a few units as in trained routers (Qwen3-30B-A3B's top-8 of 128: a median margin of a
# few tenths), so a prompt of a dozen tokens meets margins down to a few hundredths. f32 against f64 (errors ~1e-6)
# flips none of them; an engine error of a few percent would flip some.
MOE = {s.name: s for s in [
    Shape("tiny-qwen3moe", "tiny-qwen3moe", "qwen3moe", 2, 256, 8, 4, 32, 512, 256, 1e6, 1e-6, True, "qwen2_bpe",
          qk_norm=True, n_expert=8, n_expert_used=2, n_ff_exp=128),
    Shape("tiny-mixtral", "tiny-mixtral", "llama", 2, 256, 4, 2, 64, 512, 256, 1e6, 1e-5, False, "llama_spm",
          n_expert=4, n_expert_used=2, n_ff_exp=512),
    Shape("tiny-qwen2moe", "tiny-qwen2moe", "qwen2moe", 2, 256, 8, 2, 32, 512, 256, 1e6, 1e-6, False, "qwen2_bpe",
          qkv_bias=True, n_expert=8, n_expert_used=2, n_ff_exp=128, n_ff_shexp=384),
]}
MOE_FORMATS = ["f32", "q8_0"]
# And tiny-mixtral in Q4_K (every width a multiple of 256, the experts' down projections included): the f16 engine's
# decode reads K-quant experts where they lie (engine/ops/qgemv GemvExpertRows), a path only these formats take.
MOE_KQUANT = {"tiny-mixtral": ["q4_k"]}
ROUTER_LOGIT_STD = 2.0

FULL = {s.name: s for s in [
    Shape("qwen2.5-0.5b", "qwen2.5-0.5b", "qwen2", 24, 896, 14, 2, 64, 4864, 32768, 1e6, 1e-6, True,
          "qwen2_bpe", n_vocab=151936, qkv_bias=True),
    Shape("tinyllama-1.1b", "tinyllama-1.1b", "llama", 22, 2048, 32, 4, 64, 5632, 2048, 10000.0, 1e-5, False,
          "llama_spm", n_vocab=32000),
    # Llama 2 7B's shape, F16 by default: the tensor-parallel engine's decode benchmark (the Q4_K file is
    # gen_fixtures --shape llama-7b-q4k).
    Shape("llama-7b", "llama-7b", "llama", 32, 4096, 32, 32, 128, 11008, 4096, 10000.0, 1e-5, False,
          "llama_spm", n_vocab=32000),
    # SmolLM2-135M's shape (its vocabulary size, not its tokenizer), for benchmarks on hosts without it.
    Shape("smollm2-135m", "smollm2-135m", "llama", 30, 576, 9, 3, 64, 1536, 8192, 100000.0, 1e-5, True,
          "llama_spm", n_vocab=49152),
]}
FULL_FORMAT = {"qwen2.5-0.5b": "f16", "tinyllama-1.1b": "q5_k_m", "smollm2-135m": "q4_1_q8_0embd", "llama-7b": "f16"}

TINY_FORMATS = list(quants.FORMATS) + ["kmix"]

FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0, "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "q2_k": gguf.LlamaFileType.MOSTLY_Q2_K, "q3_k": gguf.LlamaFileType.MOSTLY_Q3_K_S,
    "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_S, "q5_k": gguf.LlamaFileType.MOSTLY_Q5_K_S,
    "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K, "kmix": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "q5_k_m": gguf.LlamaFileType.MOSTLY_Q5_K_M, "q4_1_q8_0embd": gguf.LlamaFileType.MOSTLY_Q4_1,
}


def load_vocab(shape: Shape) -> vocab.Vocab:
    v = vocab.qwen2_bpe() if shape.vocab == "qwen2_bpe" else vocab.llama_spm()
    return v.padded(shape.n_vocab) if shape.n_vocab else v


def tensor_shapes(shape: Shape, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name → numpy shape (rows, cols), i.e. GGUF dims reversed; in llama.cpp's file order."""
    D, F, q_dim, kv_dim = shape.n_embd, shape.n_ff, shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (n_vocab, D)}
    for i in range(shape.n_layer):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = (D,)
        out[b + "attn_q.weight"] = (q_dim, D)
        out[b + "attn_k.weight"] = (kv_dim, D)
        out[b + "attn_v.weight"] = (kv_dim, D)
        if shape.qkv_bias:
            out[b + "attn_q.bias"] = (q_dim,)
            out[b + "attn_k.bias"] = (kv_dim,)
            out[b + "attn_v.bias"] = (kv_dim,)
        if shape.qk_norm:
            out[b + "attn_q_norm.weight"] = (shape.head_dim,)
            out[b + "attn_k_norm.weight"] = (shape.head_dim,)
        out[b + "attn_output.weight"] = (D, q_dim)
        if shape.arch == "gemma3":
            out[b + "post_attention_norm.weight"] = (D,)
        out[b + "ffn_norm.weight"] = (D,)
        if shape.n_expert:
            E, Fe = shape.n_expert, shape.n_ff_exp
            out[b + "ffn_gate_inp.weight"] = (E, D)
            out[b + "ffn_gate_exps.weight"] = (E, Fe, D)
            out[b + "ffn_up_exps.weight"] = (E, Fe, D)
            out[b + "ffn_down_exps.weight"] = (E, D, Fe)
            if shape.n_ff_shexp:
                Fs = shape.n_ff_shexp
                out[b + "ffn_gate_inp_shexp.weight"] = (D,)
                out[b + "ffn_gate_shexp.weight"] = (Fs, D)
                out[b + "ffn_up_shexp.weight"] = (Fs, D)
                out[b + "ffn_down_shexp.weight"] = (D, Fs)
        else:
            out[b + "ffn_gate.weight"] = (F, D)
            out[b + "ffn_up.weight"] = (F, D)
            out[b + "ffn_down.weight"] = (D, F)
        if shape.arch == "gemma3":
            out[b + "post_ffw_norm.weight"] = (D,)
    out["output_norm.weight"] = (D,)
    if not shape.tied:
        out["output.weight"] = (n_vocab, D)
    return out


def float_weights(shape: Shape, name: str, dims: tuple[int, ...], seed: int) -> np.ndarray:
    """The float32 weight a fixture stores (before quantization), reproducible from its seed."""
    rng = np.random.default_rng([seed, zlib.crc32(shape.family.encode()), zlib.crc32(name.encode())])
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)
    if name == "token_embd.weight":
        return (0.2 * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)
    if name.endswith(".bias"):
        b = 0.1 * rng.standard_normal(dims, dtype=np.float32)
        if name.endswith("attn_k.bias"):
            # Real Qwen k biases carry a few huge channels; RoPE turns them into position-dependent scores.
            idx = rng.choice(dims[0], size=3, replace=False)
            b[idx] = rng.uniform(20.0, 40.0, size=3).astype(np.float32) * rng.choice([-1.0, 1.0], size=3)
        return b.astype(np.float32)
    if name.endswith("ffn_gate_inp.weight"):
        # The router: its input (ffn_norm) has entries of size ~1, so logits have std ROUTER_LOGIT_STD.
        return (ROUTER_LOGIT_STD / np.sqrt(dims[-1]) * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)
    std = float(np.clip(0.8 / np.sqrt(dims[-1]), 0.02, 0.05))
    return (std * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)


def _use_more_bits(layer: int, n_layer: int) -> bool:
    """llama.cpp's rule for which layers get the bigger type in the _M mixes."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def tensor_type(fmt: str, name: str, n_layer: int) -> QT:
    """The GGML type a tensor is stored in for a fixture format; norms, biases, the router and the shared expert's
    gate vector are always F32."""
    if not name.endswith(".weight") or name.endswith(("norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):
        return QT.F32
    if fmt in quants.FORMATS:
        return quants.FORMATS[fmt]
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if fmt == "kmix":  # like Q4_K_M
        if name == "token_embd.weight":
            return QT.Q8_0
        if name == "output.weight" or name.endswith("ffn_down.weight"):
            return QT.Q6_K
        if name.endswith("attn_v.weight"):
            return QT.Q5_K
        return QT.Q4_K
    if fmt == "q4_1_q8_0embd":  # like SmolLM2-135M-Instruct.Q4_1.gguf: Q4_1 with a Q8_0 (tied) embedding
        return QT.Q8_0 if name == "token_embd.weight" else QT.Q4_1
    if fmt == "q5_k_m":  # like llama.cpp's Q5_K_M
        if name == "output.weight":
            return QT.Q6_K
        if name.endswith(("attn_v.weight", "ffn_down.weight")) and _use_more_bits(layer, n_layer):
            return QT.Q6_K
        return QT.Q5_K
    raise ValueError(f"unknown format {fmt!r}")


def write_model(shape: Shape, fmt: str, path: Path, seed: int,
                extra_tensors: dict[str, np.ndarray] | None = None,
                edit: Callable[[str, np.ndarray], np.ndarray] | None = None) -> None:
    """Writes one fixture GGUF atomically (temporary name, then rename); extra_tensors (F32) go first; edit(name,
    weights) may change a tensor's float weights before they are stored."""
    v = load_vocab(shape)
    arch = shape.arch
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_type("model")
    w.add_name(f"diffrun {path.stem} (random weights, seed {seed})")
    w.add_block_count(shape.n_layer)
    w.add_context_length(shape.n_ctx)
    w.add_embedding_length(shape.n_embd)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    if arch in ("qwen3", "gemma3", "qwen3moe"):
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
    if shape.n_expert:
        w.add_expert_count(shape.n_expert)
        w.add_expert_used_count(shape.n_expert_used)
        if arch in ("qwen3moe", "qwen2moe"):
            w.add_expert_feed_forward_length(shape.n_ff_exp)
        if shape.n_ff_shexp:
            w.add_expert_shared_feed_forward_length(shape.n_ff_shexp)
    if shape.sliding_window:
        w.add_sliding_window(shape.sliding_window)
    if shape.logit_softcap:
        w.add_final_logit_softcapping(shape.logit_softcap)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_file_type(FILE_TYPES[fmt])
    w.add_vocab_size(len(v.tokens))
    w.add_rope_dimension_count(shape.head_dim)
    v.write(w)
    if fmt not in ("f32", "f16"):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    for name, dims in tensor_shapes(shape, len(v.tokens)).items():
        data = float_weights(shape, name, dims, seed)
        if edit is not None:
            data = edit(name, data)
        qtype = tensor_type(fmt, name, shape.n_layer)
        if len(dims) == 3:  # one matrix per expert: quantized as rows of the last dimension, kept 3-D
            stored = quants.quantize(data.reshape(-1, dims[-1]), qtype)
            stored = stored.reshape(dims[0], dims[1], -1)
        else:
            stored = quants.quantize(data, qtype) if len(dims) == 2 else data
        w.add_tensor(name, stored, raw_dtype=None if qtype in (QT.F32, QT.F16) else qtype)
        del data
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
