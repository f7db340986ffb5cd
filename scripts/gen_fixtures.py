#!/usr/bin/env python3
"""Writes diffrun's deterministic random-weight GGUF fixtures (see fixtures/README.md).

    scripts/gen_fixtures.py --out build/fixtures                  # every tiny fixture (seconds)
    scripts/gen_fixtures.py --out DIR --shape qwen2.5-0.5b        # full-size shape, F16
    scripts/gen_fixtures.py --out DIR --shape tinyllama-1.1b      # full-size shape, Q5_K_M mix
    scripts/gen_fixtures.py --out DIR --shape smollm2-135m        # full-size shape, Q4_1 (Q8_0 embedding)
    scripts/gen_fixtures.py --out DIR --shape llama-7b-q4k        # llama 7B shape, Q4_K blocks (3.6 GiB, never commit)
    scripts/gen_fixtures.py --out DIR --shape llama-13b-q4k       # llama 13B shape, Q4_K blocks (6.8 GiB, never commit)
    scripts/gen_fixtures.py --out DIR --shape tinyllama-1.1b --format f16   # a shape in another format
    scripts/gen_fixtures.py --out DIR --shape llama-7b --layers 4  # its widths, 4 layers (kernel work; 2.0 GiB)

Needs only numpy and the gguf package. The tiny set is skipped when a stamp in DIR says it was
written by the same generator sources, vocabularies and seed (--force rewrites it).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gguf  # noqa: E402
import numpy as np  # noqa: E402

from fixturegen import models, quants  # noqa: E402
from fixturegen.vocab import VOCAB_DIR  # noqa: E402

STAMP = ".gen_fixtures.stamp"


def tiny_files() -> list[tuple[models.Shape, str, str]]:
    return [(s, fmt, f"{s.name}-{fmt}.gguf") for s in models.TINY.values() for fmt in models.TINY_FORMATS] + \
        extra_files()


def extra_files() -> list[tuple[models.Shape, str, str]]:
    """The architectures written in a few formats only (models.EXTRA, models.MOE, models.MOE_KQUANT): tiny-gemma3,
    tiny-qwen3moe, tiny-mixtral, tiny-qwen2moe."""
    return [(s, fmt, f"{s.name}-{fmt}.gguf") for s in models.EXTRA.values() for fmt in models.EXTRA_FORMATS] + \
        [(s, fmt, f"{s.name}-{fmt}.gguf") for s in models.MOE.values() for fmt in models.MOE_FORMATS] + \
        [(models.MOE[n], fmt, f"{n}-{fmt}.gguf") for n, fmts in models.MOE_KQUANT.items() for fmt in fmts]


def gguf_version() -> str:
    try:
        return importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:  # a copied package without its dist-info
        return "unknown"


def sources_digest(seed: int) -> str:
    h = hashlib.sha256(f"seed={seed} gguf={gguf_version()}".encode())
    here = Path(__file__).resolve()
    for p in [here, *sorted((here.parent / "fixturegen").glob("*.py")), *sorted(VOCAB_DIR.glob("*.tokenizer.json"))]:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def llama3_rope_factors(head_dim: int, base: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, old_context_len: int) -> np.ndarray:
    """rope_freqs.weight as Llama 3.1's conversion computes it (convert_hf_to_gguf.py, rope_type llama3): 1 for
    wavelengths below old_context_len / high_freq_factor, `factor` above old_context_len / low_freq_factor, and
    the smooth interpolation between."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen, high_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# tiny-llama with Llama 3 RoPE scaling: a rope_freqs.weight with factors 1 (pairs 0-8), smooth (9-12) and 8
# (13-31), from factor 8, low/high frequency factors 1/4 and an original context of 256.
LLAMA3_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, old_context_len=256)
LLAMA3_ROPE_FILE = "tiny-llama3rope-f32.gguf"


def write_llama3_rope(path: Path, seed: int) -> None:
    shape = models.TINY["tiny-llama"]
    factors = llama3_rope_factors(shape.head_dim, shape.rope_theta, **LLAMA3_ROPE)
    models.write_model(shape, "f32", path, seed, extra_tensors={"rope_freqs.weight": factors})


# tiny-llama (same weights) with Mistral 7B v0.1's metadata key llama.attention.sliding_window, at 8 so a prompt of
# more than 8 tokens reaches past it. llama.cpp does not apply the key on the llama architecture; neither does diffrun.
MISTRAL = dataclasses.replace(models.TINY["tiny-llama"], name="tiny-mistral", sliding_window=8)
MISTRAL_FILE = "tiny-mistral-f32.gguf"


def write_mistral(path: Path, seed: int) -> None:
    models.write_model(MISTRAL, "f32", path, seed)


# tiny-llama (same weights) whose lm head rows come in equal pairs (row 2i+1 = row 2i), so every token's logits hold
# exact ties: each pair's two logits are the same sums of the same products, on both backends. The greedy token is
# the lower index of the best pair; an argmax that breaks ties the other way (fault argmax_ties_highest) picks 2i+1.
TIED_ROWS_FILE = "tiny-llama-tiedrows-f32.gguf"


def write_tied_rows(path: Path, seed: int) -> None:
    def pair_rows(name: str, data: np.ndarray) -> np.ndarray:
        if name != "output.weight":
            return data
        data = data.copy()
        data[1::2] = data[0:data.shape[0] // 2 * 2:2]
        return data
    models.write_model(models.TINY["tiny-llama"], "f32", path, seed, edit=pair_rows)


# Single-format variants beyond the tiny set: file name -> writer.
ONE_OFF = {LLAMA3_ROPE_FILE: write_llama3_rope, MISTRAL_FILE: write_mistral, TIED_ROWS_FILE: write_tied_rows}


LLAMA_7B = models.FULL["llama-7b"]
LLAMA_13B = models.Shape("llama-13b", "llama-13b", "llama", 40, 5120, 40, 40, 128, 13824, 4096, 10000.0, 1e-5, False,
                         "llama_spm", n_vocab=32000)
# Qwen3-30B-A3B's shape: 48 layers, D 2048, 32 query and 4 KV heads of 128, 128 experts of width 768, 8 per token,
# V 151936, untied lm head; n_ff is its config's dense width (6144), which no tensor of it uses.
QWEN3_30B_A3B = models.Shape("qwen3-30b-a3b", "qwen3-30b-a3b", "qwen3moe", 48, 2048, 32, 4, 128, 6144, 4096, 1e6, 1e-6,
                             False, "qwen2_bpe", n_vocab=151936, qk_norm=True, n_expert=128, n_expert_used=8,
                             n_ff_exp=768)
# Llama 2 70B's shape (80 layers, D 8192, 64 query and 8 KV heads, F 28672; 39 GiB in Q4_K) and Qwen2.5-14B's (48
# layers, D 5120, 40 and 8 heads, F 13824, V 152064, q/k/v biases; 8.6 GiB): the tensor-parallel engine's sizes
# (4 and 2 GPUs).
LLAMA_70B = models.Shape("llama-70b", "llama-70b", "llama", 80, 8192, 64, 8, 128, 28672, 4096, 10000.0, 1e-5, False,
                         "llama_spm", n_vocab=32000)
QWEN25_14B = models.Shape("qwen2.5-14b", "qwen2.5-14b", "qwen2", 48, 5120, 40, 8, 128, 13824, 32768, 1e6, 1e-6, False,
                          "qwen2_bpe", n_vocab=152064, qkv_bias=True)
# --shape name -> (shape, the rng stream's second key, file name): shapes whose every matrix is Q4_K.
Q4K_SHAPES = {
    "llama-7b-q4k": (LLAMA_7B, 7, "llama-7b-q4_k.gguf"),
    "llama-13b-q4k": (LLAMA_13B, 13, "llama-13b-q4_k.gguf"),
    "qwen3-30b-a3b-q4k": (QWEN3_30B_A3B, 30, "qwen3-30b-a3b-q4_k.gguf"),
    "llama-70b-q4k": (LLAMA_70B, 70, "llama-70b-q4_k.gguf"),
    "qwen2.5-14b-q4k": (QWEN25_14B, 14, "qwen2.5-14b-q4_k.gguf"),
}


def write_q4k(name: str, path: Path, seed: int, layers: int | None = None) -> None:
    """A full-size model whose every matrix is Q4_K, for the reference's memory bound and the tolerances at size:
    llama 7B (32 layers, D 4096, F 11008, 32 heads) or 13B (40 layers, D 5120, F 13824, 40 heads), V 32000; or
    Qwen3-30B-A3B (a mixture of experts, 17 GB: each expert stack [E, N, K] Q4_K, the router ffn_gate_inp F32 as
    llama.cpp's quantizer keeps it, its logits of std models.ROUTER_LOGIT_STD as the tiny MoE fixtures').
    The blocks are random and written directly (no float weights, no quantizer), one tensor at a time, so it takes
    seconds per GB and little memory. Each value is d·sc·q - dmin·m with q uniform in 0..15, sc uniform in 4..8 and
    m = round(7.5·sc): about zero mean, and a standard deviation near the tiny fixtures' (0.02; 0.2 for the token
    table). Norm weights are 1 + 0.1·N(0, 1) in F32, as in every fixture."""
    shape, stream, _ = Q4K_SHAPES[name]
    if layers is not None:
        shape = dataclasses.replace(shape, n_layer=layers)
    v = models.load_vocab(shape)
    rng = np.random.default_rng([seed, stream])
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), shape.arch)
    w.add_type("model")
    w.add_name(f"diffrun {path.stem} (random Q4_K blocks, seed {seed})")
    w.add_block_count(shape.n_layer)
    w.add_context_length(shape.n_ctx)
    w.add_embedding_length(shape.n_embd)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    if shape.qk_norm:
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
    if shape.n_expert:
        w.add_expert_count(shape.n_expert)
        w.add_expert_used_count(shape.n_expert_used)
        w.add_expert_feed_forward_length(shape.n_ff_exp)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_S)
    w.add_vocab_size(len(v.tokens))
    w.add_rope_dimension_count(shape.head_dim)
    v.write(w)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    block_bytes = 144  # d f16 | dmin f16 | scales[12] | qs[128], 256 values
    shapes = models.tensor_shapes(shape, len(v.tokens))
    dense = {name for name, dims in shapes.items() if len(dims) == 1 or name.endswith("ffn_gate_inp.weight")}
    for name, dims in shapes.items():
        if name in dense:
            w.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            w.add_tensor_info(name, (*dims[:-1], dims[-1] // quants.QK_K * block_bytes), np.dtype(np.uint8),
                              int(np.prod(dims)) // quants.QK_K * block_bytes, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, dims in shapes.items():
        if name in dense:
            w.write_tensor_data(models.float_weights(shape, name, dims, seed))
            continue
        n = int(np.prod(dims)) // quants.QK_K
        std = 0.2 if name == "token_embd.weight" else 0.02
        sc = rng.integers(4, 9, size=(n, 8), dtype=np.uint8)
        mn = np.rint(7.5 * sc).astype(np.uint8)
        d = (std / 27.7 * rng.uniform(0.8, 1.2, size=(n, 1))).astype(np.float16).view(np.uint8).reshape(n, 2)
        qs = np.frombuffer(rng.bytes(n * 128), dtype=np.uint8).reshape(n, 128)
        blocks = np.concatenate([d, d, quants._pack_k_scales(sc, mn), qs], axis=1)  # dmin = d
        w.write_tensor_data(blocks.reshape(*dims[:-1], -1))
        del sc, mn, d, qs, blocks
    w.close()
    os.replace(tmp, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--shape", choices=sorted(models.FULL) + sorted(Q4K_SHAPES),
                    help="write one full-size shape instead of the tiny set")
    ap.add_argument("--format", choices=sorted(models.FILE_TYPES),
                    help="with --shape: the tensor format instead of the shape's usual one (e.g. f16)")
    ap.add_argument("--layers", type=int,
                    help="with --shape: this many layers instead of the shape's (its widths kept; the file name gets "
                         "-<N>L), for kernel work at full width without the whole file")
    ap.add_argument("--force", action="store_true", help="rewrite even when the stamp says up to date")
    args = ap.parse_args()
    if args.layers is not None and (args.shape is None or args.layers < 1):
        ap.error("--layers goes with --shape and takes a layer count of at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    layers = "" if args.layers is None else f"-{args.layers}L"
    if args.shape in Q4K_SHAPES:
        path = args.out / Q4K_SHAPES[args.shape][2].replace(".gguf", f"{layers}.gguf")
        write_q4k(args.shape, path, args.seed, args.layers)
        print(f"gen_fixtures: wrote {path} ({path.stat().st_size / 2**20:.1f} MiB) in {time.monotonic() - t0:.1f} s")
        return 0
    if args.format and (args.shape is None or args.shape in Q4K_SHAPES):
        ap.error("--format goes with --shape (one of the models' shapes; the *-q4k shapes are Q4_K only)")
    if args.shape:
        shape = models.FULL[args.shape]
        fmt = args.format or models.FULL_FORMAT[shape.name]
        path = args.out / f"{shape.name}-{fmt}{layers}.gguf"
        if args.layers is not None:
            shape = dataclasses.replace(shape, n_layer=args.layers)
        models.write_model(shape, fmt, path, args.seed)
        print(f"gen_fixtures: wrote {path} ({path.stat().st_size / 2**20:.1f} MiB) in {time.monotonic() - t0:.1f} s")
        return 0

    files = tiny_files()
    stamp = args.out / STAMP
    digest = sources_digest(args.seed)
    if (not args.force and stamp.exists() and stamp.read_text().strip() == digest
            and all((args.out / f).exists() for f in [*(f for _, _, f in files), *ONE_OFF])):
        print(f"gen_fixtures: {len(files) + len(ONE_OFF)} tiny fixtures in {args.out} are up to date")
        return 0
    stamp.unlink(missing_ok=True)
    total = 0
    for shape, fmt, fname in files:
        models.write_model(shape, fmt, args.out / fname, args.seed)
        total += (args.out / fname).stat().st_size
    for fname, write in ONE_OFF.items():
        write(args.out / fname, args.seed)
        total += (args.out / fname).stat().st_size
    stamp.write_text(digest + "\n")
    print(f"gen_fixtures: wrote {len(files) + len(ONE_OFF)} tiny fixtures ({total / 2**20:.1f} MiB) to {args.out} "
          f"in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
