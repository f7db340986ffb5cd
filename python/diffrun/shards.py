"""A tensor-parallel run's rank dumps read as one dump (docs/dump-format.md, "Shards").

Each rank's dump holds its piece of every checkpoint: a slice along the layout letter of its dataset's `split`
attribute (at `shard_offset`), partial sums to add up (`partial` = 1), or the whole tensor (replicated).
`RankDumps` reads the set with the interface of `Dump` (steps, names, info, get, meta) and returns whole tensors:
slices placed at their offsets (slices of the same offset are copies, KV heads where Hkv < N, and must agree),
partial sums added in float64 in rank order and rounded to float32 once, a replicated tensor rank 0's copy. This
is the merge of `diffrun compare RANKS... REF.h5` (dump/shards.cpp), which also checks the replicas and
names the rank whose slice is wrong; this reader only reads.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from . import schema
from .dump import DatasetInfo, Dump, DumpFormatError
from .schema import attr, column


def rank_paths(path: str | os.PathLike[str]) -> list[str]:
    """The .h5 files of a directory, sorted by name."""
    path = os.fspath(path)
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".h5"))
    if not files:
        raise DumpFormatError(path, "is a directory without .h5 dumps")
    return files


class RankDumps:
    """The rank dumps of one tensor-parallel run, read as one dump. Use as a context manager or close()."""

    def __init__(self, paths: Sequence[str | os.PathLike[str]]):
        paths = [os.fspath(p) for p in paths]
        self.path = os.path.dirname(paths[0]) if len(paths) > 1 else paths[0]
        dumps: list[Dump] = []
        try:
            for p in paths:
                dumps.append(Dump(p))
            self._ranks = self._ordered(dumps)
        except BaseException:
            for d in dumps:
                d.close()
            raise
        first = self._ranks[0]
        self.meta: dict[str, Any] = {k: v for k, v in first.meta.items() if k not in (attr.rank, attr.world_size)}
        self.world_size = len(self._ranks)

    @staticmethod
    def _ordered(dumps: list[Dump]) -> list[Dump]:
        """The dumps by rank: each a rank dump of one world size, every rank once, the same steps and config."""
        by_rank: dict[int, Dump] = {}
        world = None
        for d in dumps:
            if attr.rank not in d.meta or attr.world_size not in d.meta:
                raise DumpFormatError(d.path, f"is not a rank dump (no root attributes {attr.rank} and {attr.world_size})")
            r, w = int(d.meta[attr.rank]), int(d.meta[attr.world_size])
            if world is not None and w != world:
                raise DumpFormatError(d.path, f"world_size {w}, the other rank dumps' is {world}")
            world = w
            if r in by_rank:
                raise DumpFormatError(d.path, f"rank {r} given twice (also {by_rank[r].path})")
            by_rank[r] = d
        missing = [r for r in range(world or 0) if r not in by_rank]
        if missing:
            raise DumpFormatError(dumps[0].path, f"rank {', '.join(map(str, missing))} of world_size {world} missing")
        ordered = [by_rank[r] for r in range(world or 0)]
        config = [a.name for a in schema.ROOT_ATTRIBUTES if a.config]
        for d in ordered[1:]:
            if d.steps() != ordered[0].steps():
                raise DumpFormatError(d.path, f"steps {d.steps()}, rank 0's are {ordered[0].steps()}")
            for a in config:
                if d.meta.get(a) != ordered[0].meta.get(a):
                    raise DumpFormatError(d.path, f"root attribute {a} is {d.meta.get(a)!r}, rank 0's "
                                                  f"{ordered[0].meta.get(a)!r}")
        return ordered

    def steps(self) -> list[int]:
        return self._ranks[0].steps()

    def names(self, step: int = 0) -> list[str]:
        names = self._ranks[0].names(step)
        for d in self._ranks[1:]:
            if sorted(d.names(step)) != sorted(names):
                raise DumpFormatError(d.path, f"step {step} holds other checkpoints than rank 0's")
        return names

    def _shard(self, d: Dump, name: str, step: int) -> tuple[str | None, int, bool]:
        a = d._attrs(step, name)
        split = a.get(column.split) or None
        return (str(split) if split else None), int(a.get(column.shard_offset, 0)), bool(a.get(column.partial, 0))

    def info(self, name: str, step: int = 0) -> DatasetInfo:
        """Rank 0's info with the whole tensor's shape."""
        import dataclasses
        info = self._ranks[0].info(name, step)
        split, _, _ = self._shard(self._ranks[0], name, step)
        if split is None:
            return info
        shape = list(info.shape)
        shape[info.dims.index(split)] = self._full(split, name, step)
        return dataclasses.replace(info, shape=tuple(shape), stored_layout=None, stored_shape=None)

    def _full(self, split: str, name: str, step: int) -> int:
        letter_attr = schema.DIMS.get(split)
        if not letter_attr or letter_attr not in self.meta:
            raise DumpFormatError(self._ranks[0].path, f"split along '{split}', which no root attribute sizes "
                                                       "(T and S are not merged)", f"step {step}/{name}")
        return int(self.meta[letter_attr])

    def get(self, name: str, step: int = 0) -> np.ndarray:
        """The whole checkpoint: slices placed, partial sums added, rank 0's copy of a replicated one."""
        shards = [self._shard(d, name, step) for d in self._ranks]
        splits = {s for s, _, _ in shards}
        partials = {p for _, _, p in shards}
        where = f"step {step}/{name}"
        if len(splits) > 1 or len(partials) > 1:
            raise DumpFormatError(self.path, "stored otherwise on different ranks (split or partial)", where)
        split, partial = splits.pop(), partials.pop()
        if partial:
            total = sum(d.get(name, step).astype(np.float64) for d in self._ranks)
            return np.asarray(total, dtype=np.float32)
        if split is None:
            return self._ranks[0].get(name, step)
        info = self._ranks[0].info(name, step)
        axis = info.dims.index(split)
        full = self._full(split, name, step)
        out: np.ndarray | None = None
        filled = np.zeros(full, dtype=bool)
        for d, (_, offset, _) in zip(self._ranks, shards):
            piece = d.get(name, step)
            extent = piece.shape[axis]
            if offset + extent > full:
                raise DumpFormatError(d.path, f"slice {split} {offset}..{offset + extent - 1} passes {split} = {full}",
                                      where)
            if out is None:
                shape = list(piece.shape)
                shape[axis] = full
                out = np.zeros(shape, dtype=piece.dtype)
            index = [slice(None)] * piece.ndim
            index[axis] = slice(offset, offset + extent)
            if filled[offset:offset + extent].any():
                if not (filled[offset:offset + extent].all() and np.array_equal(out[tuple(index)], piece)):
                    raise DumpFormatError(d.path, f"its slice {split} {offset}..{offset + extent - 1} overlaps "
                                                  "another rank's and is not the same copy", where)
                continue
            out[tuple(index)] = piece
            filled[offset:offset + extent] = True
        if not filled.all():
            gap = int(np.argmin(filled))
            raise DumpFormatError(self.path, f"no rank holds {split} {gap} (of {full})", where)
        assert out is not None
        return out

    def close(self) -> None:
        for d in self._ranks:
            d.close()

    @property
    def closed(self) -> bool:
        return all(d.closed for d in self._ranks)

    def __enter__(self) -> "RankDumps":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RankDumps({self.path!r}, world_size={self.world_size}, steps={len(self.steps())})"


def open_ranks(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> RankDumps:
    """A directory of rank dumps, or their paths, read as one dump."""
    if isinstance(path, (str, os.PathLike)):
        return RankDumps(rank_paths(path))
    return RankDumps(list(path))
