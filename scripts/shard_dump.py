#!/usr/bin/env python3
"""Splits a whole dump into N rank dumps the way a Megatron-style tensor-parallel engine shards its tensors.

    python3 scripts/shard_dump.py reference.h5 OUT_DIR --ranks 2 [--corrupt 'Qcur-0:1'] [--drop-rank 1]

Writes OUT_DIR/rank0.h5 .. rank{N-1}.h5 through diffrun's Python writer (root attributes rank and world_size; each
checkpoint's split, shard_offset or partial, docs/dump-format.md "Shards"):

- column-parallel outputs are split along their head or channel letter: Qcur, Qnorm, Qrope, kqv_out (H),
  kq_soft_max (H), Kcur, Knorm, Krope, Vcur, cache_k, cache_v (Hkv; where n_head_kv < N each KV head is copied to
  the N / n_head_kv ranks that need it), ffn_gate, ffn_up, ffn_swiglu, ffn_geglu (F);
- row-parallel outputs before the all-reduce, attn_out and ffn_out, are partial sums. This split is synthetic: the
  value is cut into N float32 parts by its mantissa bits (the high bits, then the next ones, ..., the rest), which
  add up to it exactly in float64, instead of recomputing each rank's product of its kqv_out or ffn_swiglu slice
  with its rows of the output weight. The merge therefore gives the whole dump back bit for bit;
- everything else (norms, residuals, the logits, MoE kinds) is replicated on every rank.

--corrupt NAME:RANK[:STEP] scales that rank's first local head (or channel, or its partial) of checkpoint NAME at
STEP (default 0) by 1.5, a seeded shard bug; --drop-rank and --world-size write a broken set for the error cases.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import diffrun  # noqa: E402
from diffrun import schema  # noqa: E402
from diffrun.schema import attr  # noqa: E402

# The Megatron layout: the letter each column-parallel kind is split along; the row-parallel (partial) kinds.
SPLIT = {"Qcur": "H", "Qnorm": "H", "Qrope": "H", "kqv_out": "H", "kq_soft_max": "H",
         "Kcur": "Hkv", "Knorm": "Hkv", "Krope": "Hkv", "Vcur": "Hkv", "cache_k": "Hkv", "cache_v": "Hkv",
         "ffn_gate": "F", "ffn_up": "F", "ffn_swiglu": "F", "ffn_geglu": "F"}
PARTIAL = {"attn_out", "ffn_out"}


def slice_of(size: int, ranks: int, rank: int) -> tuple[int, int]:
    """Rank's [from, to) of `size` items: an equal share, or, with fewer items than ranks, the one item it copies."""
    if size >= ranks:
        if size % ranks:
            raise SystemExit(f"a dimension of {size} does not split over {ranks} ranks")
        n = size // ranks
        return rank * n, (rank + 1) * n
    if ranks % size:
        raise SystemExit(f"{size} KV heads cannot be copied evenly to {ranks} ranks")
    i = rank * size // ranks
    return i, i + 1


def partials(v: np.ndarray, ranks: int) -> list[np.ndarray]:
    """N float32 arrays adding up to v exactly in float64: v's mantissa cut into N pieces, high bits first."""
    v = v.astype(np.float32)
    parts, rest = [], v.copy()
    for k in range(ranks - 1):
        keep = max(1, 23 - (k + 1) * (23 // ranks))  # mantissa bits this part keeps
        bits = rest.view(np.uint32) & np.uint32(~((1 << (23 - keep)) - 1) & 0xFFFFFFFF)
        head = bits.view(np.float32)
        parts.append(head)
        rest = (rest.astype(np.float64) - head.astype(np.float64)).astype(np.float32)  # exact: the low bits
    parts.append(rest)
    return parts


def shard(source: str, out_dir: str, ranks: int, corrupt: tuple[str, int, int] | None, drop: int | None,
          world_size: int | None) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    with diffrun.open(source) as d:
        meta = dict(d.meta)
        for rank in range(ranks):
            if rank == drop:
                continue
            path = os.path.join(out_dir, f"rank{rank}.h5")
            m = {k: v for k, v in meta.items() if k in schema.ROOT}
            m[attr.rank], m[attr.world_size] = rank, world_size or ranks
            with diffrun.writer.open(path, backend=str(meta[attr.backend]), precision=str(meta[attr.precision]),
                                     meta=m) as w:
                for step in d.steps():
                    w.step(step)
                    for name in d.names(step):
                        write_one(w, d, name, step, rank, ranks, corrupt)
            paths.append(path)
    return paths


def write_one(w, d, name: str, step: int, rank: int, ranks: int, corrupt) -> None:
    info = d.info(name, step)
    value = d.get(name, step)
    base = name.split("-")[0]
    hit = corrupt is not None and corrupt[0] == name and corrupt[1] == rank and corrupt[2] == step
    if name == "tokens":
        w.put(name, value)
    elif base in SPLIT and SPLIT[base] in info.dims:
        axis = info.dims.index(SPLIT[base])
        lo, hi = slice_of(value.shape[axis], ranks, rank)
        piece = np.take(value, np.arange(lo, hi), axis=axis).copy()
        if hit:  # the rank's first local head (or channel) scaled
            np.moveaxis(piece, axis, 0)[0] *= 1.5
        w.put(name, piece, layout=info.layout, split=SPLIT[base], shard_offset=lo)
    elif base in PARTIAL:
        part = partials(value, ranks)[rank]
        w.put(name, part * 1.5 if hit else part, layout=info.layout, partial=True)
    else:
        w.put(name, value * 1.5 if hit else value, layout=info.layout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dump")
    p.add_argument("out_dir")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--corrupt", help="NAME:RANK[:STEP]: scale that rank's first local slice of NAME by 1.5")
    p.add_argument("--drop-rank", type=int, help="leave this rank's dump out (a broken set)")
    p.add_argument("--world-size", type=int, help="write this world_size instead of --ranks (a broken set)")
    a = p.parse_args()
    corrupt = None
    if a.corrupt:
        parts = a.corrupt.split(":")
        corrupt = (parts[0], int(parts[1]), int(parts[2]) if len(parts) > 2 else 0)
    for path in shard(a.dump, a.out_dir, a.ranks, corrupt, a.drop_rank, a.world_size):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
