"""Quantization to ggml block formats for the fixtures: the gguf package where it can, numpy K-quants where it can't.

The K-quant quantizers here are simple (one pass, no search for the best scales, unlike llama.cpp)
but write valid ggml blocks: gguf.quants.dequantize reads them back close to the input. Each works
on rows whose length is a multiple of QK_K = 256 and is vectorized over all blocks at once.
Only numpy and gguf are needed (the generator runs on hosts with nothing else).
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

QK_K = 256

FORMATS = {
    "f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16,
    "q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q5_0": QT.Q5_0, "q5_1": QT.Q5_1,
    "q2_k": QT.Q2_K, "q3_k": QT.Q3_K, "q4_k": QT.Q4_K, "q5_k": QT.Q5_K, "q6_k": QT.Q6_K,
}


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the value rounded to f16, as float32; its bytes) for a [n, 1] array."""
    h = x.astype(np.float16)
    return h.astype(np.float32), h.view(np.uint8).reshape(x.shape[0], 2)


def _safe_inv(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(x == 0, 0.0, 1.0 / np.where(x == 0, 1.0, x)).astype(np.float32)


def _pack_bits(q: np.ndarray, n_bytes: int, bits: int) -> np.ndarray:
    """ggml's interleaved packing: value i sits in byte (i // (n_bytes*per)) * n_bytes + i % n_bytes,
    at bit offset bits * ((i // n_bytes) % per), with per = 8 // bits values per byte.
    q: [n, m] uint8 with m a multiple of n_bytes * per; returns [n, m // per]."""
    per = 8 // bits
    n = q.shape[0]
    g = q.reshape(n, -1, per, n_bytes).astype(np.uint8)
    out = np.zeros((n, g.shape[1], n_bytes), dtype=np.uint8)
    for j in range(per):
        out |= g[:, :, j, :] << np.uint8(bits * j)
    return out.reshape(n, -1)


def _affine(blocks: np.ndarray, sub: int, qmax: int, sbits: int):
    """Scale-and-min quantization shared by Q2_K, Q4_K and Q5_K: x ≈ d*sc*q - dmin*m per sub-block.
    Returns d and dmin bytes, the integer scales and mins [n, n_sub], and q [n, QK_K]."""
    n = blocks.shape[0]
    x = blocks.reshape(n, -1, sub)
    lo = np.minimum(x.min(axis=-1), 0.0)
    scale = (x.max(axis=-1) - lo) / qmax
    smax = (1 << sbits) - 1
    d, d_bytes = _f16(scale.max(axis=-1, keepdims=True) / smax)
    dmin, dmin_bytes = _f16((-lo).max(axis=-1, keepdims=True) / smax)
    sc = np.clip(np.rint(scale * _safe_inv(d)), 0, smax).astype(np.uint8)
    mn = np.clip(np.rint(-lo * _safe_inv(dmin)), 0, smax).astype(np.uint8)
    step = (d * sc)[..., None]
    offset = (dmin * mn)[..., None]
    q = np.clip(np.rint((x + offset) * _safe_inv(step)), 0, qmax).astype(np.uint8)
    return d_bytes, dmin_bytes, sc, mn, q.reshape(n, QK_K)


def _symmetric(blocks: np.ndarray, sub: int, qmax: int, sbits_max: int):
    """x ≈ d*sc*q per sub-block with q in [-qmax-1, qmax] and sc in [0, sbits_max]: Q3_K and Q6_K."""
    n = blocks.shape[0]
    x = blocks.reshape(n, -1, sub)
    scale = np.abs(x).max(axis=-1) / qmax
    d, d_bytes = _f16(scale.max(axis=-1, keepdims=True) / sbits_max)
    sc = np.clip(np.rint(scale * _safe_inv(d)), 0, sbits_max).astype(np.int32)
    step = (d * sc)[..., None]
    q = np.clip(np.rint(x * _safe_inv(step)), -qmax - 1, qmax).astype(np.int32)
    return d_bytes, sc, q.reshape(n, QK_K)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins into ggml's 12-byte get_scale_min_k4 layout."""
    b = np.empty((sc.shape[0], 12), dtype=np.uint8)
    b[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    b[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    b[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return b


def quantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine(blocks, 16, 3, 4)
    scales = (sc | (mn << 4)).astype(np.uint8)
    qs = np.concatenate([_pack_bits(q[:, h * 128:(h + 1) * 128], 32, 2) for h in range(2)], axis=1)
    return np.concatenate([scales, qs, d, dmin], axis=1)


def quantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    d, sc, q = _symmetric(blocks, 16, 3, 31)
    s = (sc + 32).astype(np.uint8)
    scales = np.empty((blocks.shape[0], 12), dtype=np.uint8)
    scales[:, 0:8] = (s[:, 0:8] & 0x0F) | ((s[:, 8:16] & 0x0F) << 4)
    hi = (s >> 4) & 0x03
    scales[:, 8:12] = hi[:, 0:4] | (hi[:, 4:8] << 2) | (hi[:, 8:12] << 4) | (hi[:, 12:16] << 6)
    low = ((q + 4) & 3).astype(np.uint8)
    high = (q >= 0).astype(np.uint8)
    hmask = _pack_bits(high, 32, 1)
    qs = np.concatenate([_pack_bits(low[:, h * 128:(h + 1) * 128], 32, 2) for h in range(2)], axis=1)
    return np.concatenate([hmask, qs, scales, d], axis=1)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine(blocks, 32, 15, 6)
    qs = np.concatenate([_pack_bits(q[:, g * 64:(g + 1) * 64], 32, 4) for g in range(4)], axis=1)
    return np.concatenate([d, dmin, _pack_k_scales(sc, mn), qs], axis=1)


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine(blocks, 32, 31, 6)
    low = q & 0x0F
    qh = _pack_bits(q >> 4, 32, 1)
    qs = np.concatenate([_pack_bits(low[:, g * 64:(g + 1) * 64], 32, 4) for g in range(4)], axis=1)
    return np.concatenate([d, dmin, _pack_k_scales(sc, mn), qh, qs], axis=1)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    d, sc, q = _symmetric(blocks, 16, 31, 127)
    u = (q + 32).astype(np.uint8)
    low, high = u & 0x0F, u >> 4
    ql = np.concatenate([_pack_bits(low[:, h * 128:(h + 1) * 128], 64, 4) for h in range(2)], axis=1)
    qh = np.concatenate([_pack_bits(high[:, h * 128:(h + 1) * 128], 32, 2) for h in range(2)], axis=1)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d], axis=1)


K_QUANTIZERS = {QT.Q2_K: quantize_q2_k, QT.Q3_K: quantize_q3_k, QT.Q4_K: quantize_q4_k,
                QT.Q5_K: quantize_q5_k, QT.Q6_K: quantize_q6_k}


def quantize(data: np.ndarray, qtype: QT, chunk_rows: int = 4096) -> np.ndarray:
    """float32 [rows, cols] → the ggml bytes (uint8 [rows, bytes per row]) or float array for F32/F16/BF16."""
    fn = K_QUANTIZERS.get(qtype)
    if fn is None:
        return gq.quantize(data, qtype)
    block_size, type_size = gq.GGML_QUANT_SIZES[qtype]
    rows, cols = data.shape
    if cols % block_size:
        raise ValueError(f"row length {cols} is not a multiple of the {qtype.name} block size {block_size}")
    out = np.empty((rows, cols // block_size * type_size), dtype=np.uint8)
    for r in range(0, rows, chunk_rows):
        part = data[r:r + chunk_rows].astype(np.float32, copy=False)
        out[r:r + chunk_rows] = fn(part.reshape(-1, block_size)).reshape(part.shape[0], -1)
    return out
