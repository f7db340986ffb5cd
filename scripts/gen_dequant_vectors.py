#!/usr/bin/env python3
"""Writes dequantization test vectors: random ggml blocks and what gguf.quants.dequantize makes of them.

For each format FMT, tests/data/dequant/FMT.blocks holds raw blocks as they lie in a GGUF file and
FMT.f32 the float32 values the gguf package's dequantizer returns for them (little-endian).
f32_to_f16.in / .out hold float32 inputs and numpy's round-to-nearest-even float16 bits.
manifest.json lists formats, ggml type numbers and element counts. Deterministic (fixed seed).

The half-precision scale fields (d, m, dmin) of the blocks cycle through special values: +-0,
subnormals, the largest half, inf and NaN, as well as ordinary scales; F16 covers all 65536 halves.

Usage: scripts/gen_dequant_vectors.py [OUT_DIR]   (default: tests/data/dequant next to this script)
"""
import json
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

SEED = 20240601

SPECIAL_HALVES = [
    0x0000,  # +0
    0x8000,  # -0
    0x0001,  # smallest subnormal
    0x8001,  # smallest negative subnormal
    0x03FF,  # largest subnormal
    0x0400,  # smallest normal
    0x7BFF,  # 65504, largest half
    0xFBFF,  # -65504
    0x7C00,  # +inf
    0xFC00,  # -inf
    0x7E00,  # quiet NaN
    0x3C00,  # 1.0
]

# Byte offsets of the half-precision scale fields inside one block, per format.
HALF_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
N_BLOCKS = {32: 64, 256: 16}


def ordinary_halves(rng, n):
    """Scales like real models have: magnitudes 2^-14 .. 2^2, either sign."""
    mag = np.exp2(rng.uniform(-14, 2, n)).astype(np.float32)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0).astype(np.float32)
    return (mag * sign).astype(np.float16).view(np.uint16)


def quant_blocks(rng, qtype):
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    n = N_BLOCKS[block_elems]
    blocks = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    fields = HALF_FIELDS[qtype]
    ordinary = ordinary_halves(rng, n * len(fields))
    for b in range(n):
        for k, off in enumerate(fields):
            # First blocks: each field walks the special list (shifted per field so pairs differ);
            # the rest: ordinary scales, with an occasional special one.
            if b < len(SPECIAL_HALVES) * 2:
                h = SPECIAL_HALVES[(b + 5 * k) % len(SPECIAL_HALVES)]
            elif rng.random() < 0.1:
                h = SPECIAL_HALVES[rng.integers(len(SPECIAL_HALVES))]
            else:
                h = int(ordinary[b * len(fields) + k])
            blocks[b, off:off + 2] = np.array([h], dtype="<u2").view(np.uint8)
    return blocks.reshape(-1)


def f32_values(rng, n):
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 1e-45, -1e-45, 1.1754942e-38,
                        3.4028235e38, -3.4028235e38, 65504.0, 65520.0, 6.1e-5, 5.9604645e-08],
                       dtype=np.float32)
    body = (rng.standard_normal(n - len(special)) * np.exp2(rng.uniform(-30, 20, n - len(special))))
    return np.concatenate([special, body.astype(np.float32)])


def f32_to_f16_inputs(rng, n):
    """Values around half's rounding boundaries, subnormals, overflow threshold and ties."""
    base = f32_values(rng, n // 2)
    halves = rng.integers(0, 0x7C00, size=n // 4, dtype=np.uint32)  # finite halves
    h32 = halves.astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
    # exactly halfway to the next half, and one f32 ulp either side of it
    tie = h32 + (1 << 12)
    near = np.concatenate([tie, tie - 1, tie + 1])[: n - len(base)]
    signs = (rng.random(len(near)) < 0.5).astype(np.uint32) << 31
    vals = np.concatenate([base, (near | signs).view(np.float32)])
    return vals


def main():
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "tests/data/dequant"
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    entries = []

    def emit(name, qtype, raw):
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        expected = gguf.quants.dequantize(raw.reshape(1, -1), qtype).reshape(-1).astype("<f4", copy=False)
        assert expected.size == raw.size // block_bytes * block_elems
        (out / f"{name}.blocks").write_bytes(raw.tobytes())
        (out / f"{name}.f32").write_bytes(expected.tobytes())
        entries.append({"format": name, "ggml_type": int(qtype), "n_elements": int(expected.size)})

    emit("F32", T.F32, f32_values(rng, 1024).astype("<f4").view(np.uint8))
    emit("F16", T.F16, np.arange(65536, dtype="<u2").view(np.uint8))
    bf = np.concatenate([np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x7F80,
                                   0xFF80, 0x7FC0, 0x7F81, 0x3F80], dtype="<u2"),
                         rng.integers(0, 65536, size=4096 - 13, dtype=np.uint16).astype("<u2")])
    emit("BF16", T.BF16, bf.view(np.uint8))
    for qtype in HALF_FIELDS:
        emit(qtype.name, qtype, quant_blocks(rng, qtype))

    inputs = f32_to_f16_inputs(rng, 4096).astype("<f4")
    inputs = inputs[~np.isnan(inputs)]  # NaN payload rounding is not specified; tested separately
    (out / "f32_to_f16.in").write_bytes(inputs.tobytes())
    (out / "f32_to_f16.out").write_bytes(inputs.astype(np.float16).view("<u2").tobytes())

    manifest = {
        "generator": "scripts/gen_dequant_vectors.py",
        "seed": SEED,
        "gguf_version": getattr(gguf, "__version__", None) or _package_version(),
        "numpy_version": np.__version__,
        "formats": entries,
        "f32_to_f16": {"n": int(inputs.size)},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def _package_version():
    from importlib.metadata import version
    return version("gguf")


if __name__ == "__main__":
    with np.errstate(all="ignore"):  # inf and NaN scales are on purpose
        main()
