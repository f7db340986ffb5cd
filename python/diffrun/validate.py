"""Checks a dump against docs/dump-format.md and lists every problem at once: `diffrun validate`'s checks
(dump/dump_validate.cpp) in Python, with the same wording, both driven by the dump schema (diffrun.schema:
every attribute, type, allowed value, limit, dimension letter, kind and architecture comes from it; DESIGN.md,
"One validator", says why neither calls the other).

    problems = diffrun.validate.validate("mine.h5")      # [Problem(where, what), ...]; [] when valid
    python -m diffrun.validate mine.h5 [--json]          # exit 0 valid, 1 problems, 2 unreadable

Reads attributes and shapes only (the data of `tokens` aside), so validating a large dump is quick.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import h5py
import numpy as np

from . import attributes, schema, vocabulary
from .attributes import class_text as _class_text
from .dump import (ATTRIBUTE_TABLE, FORMAT_VERSIONS, DumpFormatError, link_refusal, read_attribute_table,
                   storage_refusal)
from .schema import attr, column, dim

# The root attributes, their types and allowed values: dump_schema.json (diffrun.schema).
ROOT_ATTRIBUTES = schema.ROOT_ATTRIBUTES
NATIVE_DTYPES = schema.NATIVE_DTYPES
INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
# The most layers a dump may declare: the readers' limit (the schema's max of n_layer). Every name list is sized by
# n_layer, so a dump declaring 2e9 layers would exhaust memory before anything else is checked.
MAX_LAYERS: int = schema.ROOT[attr.n_layer].max or 0


@dataclass(frozen=True)
class Problem:
    where: str
    what: str


@dataclass
class Result:
    path: str
    problems: list[Problem] = field(default_factory=list)
    # Not problems: what the dump leaves open (dims of one size without a layout attribute), one per step and message.
    warnings: list[Problem] = field(default_factory=list)
    n_steps: int = 0
    n_datasets: int = 0

    @property
    def valid(self) -> bool:
        return not self.problems


@dataclass
class _Config:
    """A dump's config attributes (schema.CONFIG_ATTRIBUTES by name) and the features they imply."""
    values: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def features(self) -> dict[str, Any]:
        """The architecture's features, with those the dump states as attributes (qk_norm, ...) taken from it."""
        return schema.stated_features(self.values)

    def size(self, letter: str, n_tokens: int, n_kv: int) -> int:
        return schema.dim_sizes(self.values, n_tokens, n_kv)[letter]


# --- root attributes -----------------------------------------------------------------------------------------

def _type_problem(a: schema.Attribute, s: attributes.Shape) -> str:
    got = "is " + _class_text(s.cls)
    scalar = s.n == 1 and s.rank <= 1
    if s.cls not in attributes.ACCEPTED_CLASSES[a.type]:
        return got + ", expected " + a.expected
    if a.type == "integer array":
        return "" if s.rank == 1 else f"has rank {s.rank}, expected " + a.expected
    if not scalar:
        return f"holds {s.n} strings, expected one" if a.type == "string" else f"holds {s.n} values, expected one"
    return ""


@dataclass
class _Root:
    problems: list[Problem] = field(default_factory=list)
    config: _Config | None = None
    token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] | None = None
    argmax: list[int] | None = None
    format_version: int = 0  # 0: unknown (missing or unreadable)
    world_size: int | None = None  # a rank dump's (valid rank and world_size)


def _read_root_value(f: h5py.File, a: schema.Attribute, problem: Callable[[str, str], None]) -> Any:
    """One root attribute's value, checked against its type and allowed values; None (and a problem) when it
    is not usable."""
    if a.type == "string":
        v = attributes.read_string(f, a.name)
        if v is None:
            problem(a.name, "cannot be read as a string")
        elif a.values and v not in a.values:
            problem(a.name, f'is "{v}", expected {schema.quoted(a.values)}')
        elif a.nonempty and not v:
            problem(a.name, f"is empty ({a.nonempty})")
        else:
            return v
        return None
    if a.type in ("integer", "boolean"):
        v = attributes.read_ints(f, a.name)
        if v is None or len(v) != 1:
            problem(a.name, "cannot be read as an integer")
            return None
        x = v[0]
        if a.type == "boolean" and x not in (0, 1):
            problem(a.name, f"is {x}, expected a boolean (0 or 1)")
        elif a.type == "integer" and not INT32_MIN <= x <= INT32_MAX:
            problem(a.name, f"is {x}, outside int32")
        else:
            return x
        return None
    if a.type == "real":
        v = attributes.read_real(f, a.name)
        if v is None:
            problem(a.name, "cannot be read as a real")
        return v
    v = attributes.read_ints(f, a.name)
    if v is None:
        problem(a.name, "cannot be read as integers")
    return v


def _check_config(values: dict[str, Any], problem: Callable[[str, str], None]) -> _Config | None:
    """The config when every config attribute is there and sane; each insane one is a problem."""
    ok = True
    for a in schema.CONFIG_ATTRIBUTES:
        if a.name not in values:
            ok = ok and not a.required  # an optional one (the experts' sizes) is absent for a dense model
            continue
        x = values[a.name]
        if a.type == "integer" and x <= 0:
            problem(a.name, f"is {x}, expected a positive integer")
            ok = False
        elif a.type == "integer" and a.max is not None and x > a.max:
            problem(a.name, f"is {x}, outside 1..{a.max}" + (f" ({a.max_why})" if a.max_why else ""))
            ok = False
        elif a.positive and not x > 0:
            problem(a.name, f"is {x:f}, expected a positive real")
            ok = False
    for a in schema.CONFIG_ATTRIBUTES:
        if a.divides and values.get(a.name, 0) > 0 and a.divides in values and values[a.divides] % values[a.name]:
            problem(a.name, f"is {values[a.name]}, which does not divide {a.divides} = {values[a.divides]}")
            ok = False
    return _Config({a.name: values[a.name] for a in schema.CONFIG_ATTRIBUTES if a.name in values}) if ok else None


def _check_root(f: h5py.File) -> _Root:
    r = _Root()

    def problem(name: str, what: str) -> None:
        r.problems.append(Problem(f"root attribute '{name}'", what))

    values: dict[str, Any] = {}
    # The version first: from version 2 on strings are fixed-length, and a variable-length one is
    # reported without being read (HDF5 1.10 crashes on some damaged global heaps).
    version = attr.format_version
    s = attributes.inspect(f, version)
    if s.exists and s.cls == h5py.h5t.INTEGER and s.n == 1:
        v = attributes.read_ints(f, version)
        if v and len(v) == 1 and 1 <= v[0] <= INT32_MAX:
            r.format_version = v[0]
    for a in ROOT_ATTRIBUTES:
        s = attributes.inspect(f, a.name)
        if not s.exists:
            if a.required:
                problem(a.name, f"missing ({a.expected})")
            continue
        p = _type_problem(a, s)
        if p:
            problem(a.name, p)
            continue
        if s.vlen and r.format_version >= 2:
            problem(a.name, f"is a variable-length string; format version {r.format_version} stores fixed-length strings")
            continue
        v = _read_root_value(f, a, problem)
        if v is not None:
            values[a.name] = v

    if version in values and values[version] not in FORMAT_VERSIONS:
        problem(version, f"is {values[version]}, this diffrun reads versions {FORMAT_VERSIONS[0]} to {FORMAT_VERSIONS[-1]}")
    r.config = _check_config(values, problem)
    _check_ids(r, values, problem)
    _check_rank(r, values, problem)
    return r


def _check_rank(r: _Root, values: dict[str, Any], problem: Callable[[str, str], None]) -> None:
    """A rank dump's rank and world size (docs/dump-format.md, "Shards"): both or neither, 0 <= rank < world_size."""
    rank, world = values.get(attr.rank), values.get(attr.world_size)
    if (rank is None) != (world is None):
        problem(attr.world_size if rank is not None else attr.rank,
                f"missing: a rank dump has both {attr.rank} and {attr.world_size}")
        return
    if rank is None:
        return
    r.world_size = world
    most = next(a for a in ROOT_ATTRIBUTES if a.name == attr.world_size).max
    if not 1 <= world <= most:
        problem(attr.world_size, f"is {world}, outside 1..{most}")
    elif not 0 <= rank < world:
        problem(attr.rank, f"is {rank}, outside 0..{world - 1} (world_size {world})")


def _shard_problems(world_size: int | None, split: str | None, offset: int | None, partial: int | None) -> list[str]:
    """A dataset's shard attributes on their own: split along a letter, partial 0 or 1 and not with split,
    shard_offset only with split, all only in a rank dump."""
    if split is None and offset is None and partial is None:
        return []
    out = []
    if world_size is None:
        out.append(f"shard attributes in a dump without the root attributes {attr.rank} and {attr.world_size}")
    if partial is not None and partial not in (0, 1):
        out.append(f"attribute 'partial' is {partial}, expected 0 or 1")
    if partial == 1 and split is not None:
        out.append("attributes 'split' and 'partial' together: a rank's piece is a slice or a partial sum")
    if offset is not None and split is None:
        out.append("attribute 'shard_offset' without 'split'")
    if offset is not None and offset < 0:
        out.append(f"attribute 'shard_offset' is {offset}, expected >= 0")
    return out


def _shard_config(cfg: _Config, layout_dims: list[str], split: str, offset: int, shape: tuple[int, ...],
                  rows: int, kv_rows: int) -> tuple[_Config | None, str]:
    """A rank's slice along `split`: the config with that letter's size the slice's, so that check_checkpoint
    checks the rest; the slice must lie within the whole dimension. (config, "") or (None, the problem)."""
    if split not in layout_dims or schema.DIMS.get(split) is None:
        return None, (f"attribute 'split' is '{split}', expected a letter of its layout {','.join(layout_dims)} "
                      f"other than {schema.ROW_DIM} and {schema.CACHE_DIM}")
    sizes = schema.dim_sizes(cfg.values, rows, kv_rows)
    others = int(np.prod([sizes[d] for d in layout_dims if d != split], dtype=np.int64))
    count = int(np.prod(shape, dtype=np.int64))
    full = sizes[split]
    if others <= 0 or count % others != 0 or not 1 <= count // others <= full:
        return None, (f"holds {count} values, not a slice along {split} of layout {','.join(layout_dims)} "
                      f"({split} = {full})")
    extent = count // others
    if offset + extent > full:
        return None, (f"attribute 'shard_offset' is {offset}: its slice {split} {offset}..{offset + extent - 1} "
                      f"passes {split} = {full}")
    return _Config(dict(cfg.values, **{schema.DIMS[split]: extent})), ""


def _check_ids(r: _Root, values: dict[str, Any], problem: Callable[[str, str], None]) -> None:
    """The id arrays: within the vocabulary, the prompt not empty, all_token_ids starting with it."""
    ids: dict[str, list[int] | None] = {}
    for a in ROOT_ATTRIBUTES:
        if a.type != "integer array" or a.name not in values:
            continue
        ids[a.name] = list(values[a.name])
        if a.ids:
            for x in values[a.name]:
                if x < 0 or (r.config and x >= r.config.n_vocab):
                    top = str(r.config.n_vocab - 1) if r.config else "n_vocab-1"
                    problem(a.name, f"holds id {x}, outside the vocabulary 0..{top}")
                    ids[a.name] = None
                    break
        if ids[a.name] is not None and a.nonempty and not ids[a.name]:
            problem(a.name, f"is empty ({a.nonempty})")
    prompt, every, argmax = (a.name for a in ROOT_ATTRIBUTES if a.type == "integer array")
    r.token_ids = ids.get(prompt) or []
    r.all_token_ids = ids.get(every)
    if r.all_token_ids is not None and r.token_ids and (
            len(r.all_token_ids) < len(r.token_ids) or r.all_token_ids[:len(r.token_ids)] != r.token_ids):
        problem(every, f"does not start with {prompt} (it holds the prompt, then one id per decode step)")
    r.argmax = ids.get(argmax)


# --- checkpoints ---------------------------------------------------------------------------------------------

def _order_error(cfg: _Config, base: str, layer: int) -> str | None:
    """checkpoint_order's InputError text when the name does not exist for this config, else None."""
    kind = vocabulary.find_kind(base)
    name = vocabulary.checkpoint_name(base, layer)
    if kind is None:
        return f"unknown checkpoint '{name}' (not in the checkpoint vocabulary)"
    if not kind.applies(cfg.features):
        need = schema.FEATURES.get(kind.needs.partition("=")[0], {})
        return f"checkpoint '{name}' does not exist for architecture {cfg.arch}" + need.get("absent", "")
    if kind.per_layer:
        if layer < 0 or layer >= cfg.n_layer:
            return f"checkpoint '{name}': layer {layer} outside 0..{cfg.n_layer - 1}"
        return None
    if layer >= 0:
        return f"checkpoint '{base}' is not per-layer (got '{name}')"
    return None


def _order(cfg: _Config, name: str) -> int:
    return vocabulary.names_for(cfg.features, cfg.n_layer).index(name)


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def check_checkpoint(cfg: _Config, name: str, layer: int, shape: tuple[int, ...], layout: str, n_tokens: int,
                     n_kv: int) -> str:
    """"" when the checkpoint fits the vocabulary for this config, T and S; else the problem."""
    base, parsed_layer = vocabulary.parse_name(name)
    if parsed_layer != layer:
        return f"the name says layer {parsed_layer} but the layer given is {layer}"
    kind = vocabulary.find_kind(base)
    if kind is None:
        return "not a checkpoint name of the vocabulary (diffrun vocab lists them)"
    err = _order_error(cfg, base, parsed_layer)
    if err:
        return err
    vocab_dims = kind.dims
    vocab_shape = [cfg.size(d, n_tokens, n_kv) for d in vocab_dims]
    dims = layout.split(",") if layout else vocab_dims
    if sorted(dims) != sorted(vocab_dims):
        return f"layout '{layout}' is not a permutation of the vocabulary's '{kind.layout}'"
    expected = [vocab_shape[vocab_dims.index(d)] for d in dims]
    if list(shape) == expected:
        return ""
    if dims == vocab_dims:
        for i in range(len(dims) - 1):
            if dims[i + 1] != schema.HEAD_DIM or dims[i] not in schema.HEAD_DIMS:
                continue
            merged = expected[:i] + [expected[i] * expected[i + 1]] + expected[i + 2:]
            if list(shape) == merged:
                return ""
    what = (f"shape {_shape_text(shape)} does not fit layout '{layout or kind.layout}' = {_shape_text(expected)} "
            f"(T = {n_tokens}, S = {n_kv})")
    if layout and layout != kind.layout:
        what += f"; the dims do not match the layout given with them (the vocabulary's is '{kind.layout}')"
    elif int(np.prod(shape, dtype=np.int64)) == int(np.prod(expected, dtype=np.int64)):
        what += "; same element count: a permuted array needs its layout attribute"
    return what


def _softmax_reads_as(x: np.ndarray, names: list[str], n_past: int) -> bool:
    """kq_soft_max read with its stored dims named `names`: rows summing to 1 along S, 0 on future positions."""
    p = np.transpose(x, [names.index(d) for d in (dim.H, dim.T, dim.S)]).astype(np.float64)
    if not np.all(np.isfinite(p)) or np.any(p < -1e-6):
        return False
    t = np.arange(p.shape[1])[:, None]
    s = np.arange(p.shape[2])[None, :]
    if np.any(p[:, s > n_past + t] > 1e-6):
        return False
    return bool(np.all(np.abs(p.sum(axis=2) - 1) <= 1e-2))


def _bracketed(dims: list[str]) -> str:
    return "[" + ",".join(dims) + "]"


def _layout_ambiguity(ds: h5py.Dataset, base: str, vocab_dims: list[str], shape: tuple[int, ...],
                      n_past: int) -> tuple[str, str]:
    """(problem, warning) of a dataset stored in its vocabulary shape without a layout attribute, two of whose
    dims have the same size (> 1); as layout_ambiguity in dump/dump_validate.cpp."""
    swaps = [(i, j) for i in range(len(shape)) for j in range(i + 1, len(shape)) if shape[i] == shape[j] > 1]
    if not swaps or len(vocab_dims) != len(shape):
        return "", ""
    if base == "kq_soft_max" and len(shape) == 3 and int(np.prod(shape)) <= (16 << 20) and \
            ds.id.get_type().get_class() == h5py.h5t.FLOAT:
        x = np.asarray(ds[()], dtype=np.float32)
        if _softmax_reads_as(x, list(vocab_dims), n_past):
            return "", ""
        for i, j in swaps:
            looks = list(vocab_dims)
            looks[i], looks[j] = looks[j], looks[i]
            if _softmax_reads_as(x, looks, n_past):
                return (f"the layout looks like {_bracketed(looks)}, not {_bracketed(list(vocab_dims))}: label it with "
                        "the layout attribute"), ""
    parts = []
    for i, j in swaps:
        other = list(vocab_dims)
        other[i], other[j] = other[j], other[i]
        parts.append(f"dims {vocab_dims[i]} and {vocab_dims[j]} are both {shape[i]} ({_bracketed(list(vocab_dims))} "
                     f"and {_bracketed(other)} store the same shape)")
    return "", "; ".join(parts) + ": ambiguous without a layout attribute"


def _step_number(name: str) -> int:
    if not name.startswith("step_") or len(name) <= 5:
        return -1
    step = 0
    for c in name[5:]:
        if not c.isdigit() or not c.isascii() or step > 100000000:
            return -1
        step = step * 10 + int(c)
    return step


def _float_problem(ds: h5py.Dataset) -> str | None:
    t = ds.id.get_type()
    cls, size = t.get_class(), t.get_size()
    if cls == h5py.h5t.FLOAT:
        if size == 2:
            spos, epos, esize, mpos, msize = t.get_fields()
            if (spos, epos, esize, mpos, msize) != (15, 10, 5, 0, 10) or t.get_ebias() != 15:
                return "is a 2-byte float that is not IEEE half (float16)"
        elif size not in (4, 8):
            return f"is a {size}-byte float; expected float32, float64 or float16"
        return None
    if cls == h5py.h5t.INTEGER and size == 2 and t.get_sign() == h5py.h5t.SGN_NONE:
        return None
    return f"is {_class_text(cls)} of {size} bytes; float checkpoints are float32, float64, float16, or bf16 bits in uint16"


def validate(path: str | os.PathLike[str], foreign_name: Callable[[str], bool] | None = None) -> Result:
    """Every problem of the dump at `path`; raises DumpFormatError when it cannot be read at all."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DumpFormatError(path, "no such file")
    if not os.path.isfile(path):
        raise DumpFormatError(path, "not a regular file")
    if not h5py.is_hdf5(path):
        raise DumpFormatError(path, "not an HDF5 file (no HDF5 signature: foreign or truncated)")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise DumpFormatError(path, f"cannot open the HDF5 file (truncated or damaged?) ({e})") from None
    with f:
        return _validate(path, f, foreign_name)


def _validate(path: str, f: h5py.File, foreign_name: Callable[[str], bool] | None) -> Result:
    result = Result(path)
    root = _check_root(f)
    result.problems = list(root.problems)

    def problem(where: str, what: str) -> None:
        result.problems.append(Problem(where, what))

    cfg = root.config

    # Links are checked before anything follows them; a dump that reaches outside itself is refused
    # (DumpFormatError, exit 2), not listed as a problem (docs/dump-format.md, "What readers refuse").
    def refuse_links(group: h5py.Group, prefix: str) -> None:
        for name in list(group.keys()):
            refused = link_refusal(group, name)
            if refused:
                raise DumpFormatError(path, f"'{prefix}{name}' {refused}")

    def refuse_storage(ds: h5py.Dataset, where: str) -> None:
        refused = storage_refusal(ds)
        if refused:
            raise DumpFormatError(path, refused, where)

    refuse_links(f, "")
    steps: dict[int, str] = {}
    for name in sorted(f.keys()):
        step = _step_number(name)
        if step < 0:
            continue
        if not isinstance(f.get(name, getlink=False), h5py.Group):
            problem(name, "is not a group (a step is a group of datasets)")
            continue
        if len(name) < 9:
            problem(name, f"step groups are named with at least 4 digits: 'step_{step:04d}'")
        if step in steps:
            problem(name, f"a second group for step {step} (with '{steps[step]}')")
            continue
        steps[step] = name
    if not steps:
        problem("/", "no step groups (expected /step_0000, /step_0001, ...)")
    last = max(steps) if steps else -1
    for s in range(last + 1):
        if s not in steps:
            problem(f"step_{s:04d}", f"missing: steps are numbered from 0 without gaps (last step is {last})")
    if root.argmax is not None and steps and len(root.argmax) != len(steps):
        problem("root attribute 'argmax'", f"holds {len(root.argmax)} ids for {len(steps)} steps (one per step)")
    if root.all_token_ids is not None and root.token_ids and last >= 0 and \
            len(root.all_token_ids) < len(root.token_ids) + last:
        problem("root attribute 'all_token_ids'",
                f"holds {len(root.all_token_ids)} ids; {last} decode steps after a prompt of {len(root.token_ids)} "
                f"need at least {len(root.token_ids) + last}")
    if cfg is None and steps:
        problem("/", "datasets are not checked against the vocabulary: the config attributes are incomplete")

    n_kv: int | None = 0
    for s in range(last + 1):
        if s not in steps:
            n_kv = None
            continue
        gname = steps[s]
        result.n_steps += 1
        g = f[gname]
        refuse_links(g, f"{gname}/")
        names = sorted(g.keys())
        # Version 2: the datasets' attributes are the step's attribute table.
        v2 = root.format_version >= 2
        table: dict[str, dict] = {}
        if v2 and ATTRIBUTE_TABLE in names:
            names.remove(ATTRIBUTE_TABLE)
            twhere_ = f"{gname}/{ATTRIBUTE_TABLE}"
            if isinstance(g.get(ATTRIBUTE_TABLE, getlink=False), h5py.Dataset):
                refuse_storage(g[ATTRIBUTE_TABLE], twhere_)
            try:
                table = read_attribute_table(g, twhere_)
            except (ValueError, OSError) as e:
                msg = str(e)
                problem(twhere_, msg[len(twhere_) + 2:] if msg.startswith(twhere_ + ": ") else msg)
            for tname in table:
                if tname not in names:
                    problem(twhere_, f"names '{tname}', which the step does not hold")
        n_tokens: int | None = None
        twhere = f"{gname}/tokens"
        if "tokens" not in names:
            problem(twhere, "missing (every step records the ids it was fed, int32 [T])")
        elif isinstance(g.get("tokens", getlink=False), h5py.Dataset):
            ds = g["tokens"]
            refuse_storage(ds, twhere)
            t = ds.id.get_type()
            if t.get_class() != h5py.h5t.INTEGER:
                problem(twhere, f"is {_class_text(t.get_class())}, expected int32 ids")
            elif ds.ndim != 1:
                problem(twhere, f"has rank {ds.ndim}, expected 1 ([T])")
            else:
                if t.get_size() != 4 or t.get_sign() != h5py.h5t.SGN_2:
                    problem(twhere, f"is an integer of {t.get_size()} bytes, expected int32")
                n = ds.shape[0]
                if n == 0:
                    problem(twhere, "is empty (a step feeds at least one token)")
                else:
                    v = [int(x) for x in ds[()].astype(np.int64)]
                    n_tokens = n
                    if s == 0 and root.token_ids and v != root.token_ids:
                        problem(twhere, "differs from the root attribute token_ids (step 0 is the prompt)")
                    if s > 0 and n != 1:
                        problem(twhere, f"holds {n} ids; a decode step feeds one")
                    if s > 0 and n == 1 and root.all_token_ids is not None:
                        at = len(root.token_ids) + s - 1
                        if at < len(root.all_token_ids) and root.all_token_ids[at] != v[0]:
                            problem(twhere, f"is {v[0]} but all_token_ids says {root.all_token_ids[at]} for this step")
                    if cfg:
                        for i in v:
                            if i < 0 or i >= cfg.n_vocab:
                                problem(twhere, f"holds id {i}, outside the vocabulary 0..{cfg.n_vocab - 1}")
                                break
        n_kv = n_kv + n_tokens if (n_tokens is not None and n_kv is not None) else None
        ambiguous: dict[str, list] = {}  # message -> [first dataset, how many more]

        for name in names:
            where = f"{gname}/{name}"
            ds = g.get(name, getlink=False)
            if not isinstance(ds, h5py.Dataset):
                problem(where, "is not a dataset")
                continue
            refuse_storage(ds, where)
            result.n_datasets += 1
            base, parsed_layer = vocabulary.parse_name(name)
            kind = vocabulary.find_kind(base)
            if kind is None:
                if foreign_name and foreign_name(name):
                    continue
                problem(where, "not a checkpoint name of the vocabulary nor of the name map" if foreign_name else
                        "not a checkpoint name of the vocabulary (diffrun vocab lists them; foreign names need --names)")
                continue

            row = table.get(name, {})

            def scalar_int(key: str) -> int | None:
                if v2:
                    return row.get(key)
                a = attributes.inspect(ds, key)
                if not a.exists:
                    return None
                if a.cls != h5py.h5t.INTEGER or a.n != 1:
                    problem(where, f"attribute '{key}' is {_class_text(a.cls)}{' array' if a.n != 1 else ''}, "
                                   "expected a scalar integer")
                    return None
                v = attributes.read_ints(ds, key)
                return v[0] if v and len(v) == 1 else None

            def scalar_str(key: str) -> str | None:
                if v2:
                    return row.get(key)
                a = attributes.inspect(ds, key)
                if not a.exists:
                    return None
                if a.cls != h5py.h5t.STRING or a.n != 1:
                    problem(where, f"attribute '{key}' is {_class_text(a.cls)}, expected a string")
                    return None
                return attributes.read_string(ds, key)

            order, layer = scalar_int(column.order), scalar_int(column.layer)
            row_offset = scalar_int(column.row_offset)
            row_kind = vocabulary.find_kind(base)
            row_letter = None  # the dimension a row_offset counts: T, or S for the cache
            if row_kind is not None and base != "tokens":
                row_letter = schema.CACHE_DIM if row_kind.dims[0] == schema.CACHE_DIM else (
                    schema.ROW_DIM if schema.ROW_DIM in row_kind.dims else None)
            if row_offset is not None and row_letter is None:
                problem(where, "attribute 'row_offset' is only for checkpoints with token or cache rows (kq_soft_max, "
                               "result_output, cache_k, per-token checkpoints)")
                row_offset = None
            layout, native, dtype_attr = scalar_str(column.layout), scalar_str(column.native_dtype), scalar_str(column.dtype)
            split = scalar_str(column.split)
            shard_offset, partial = scalar_int(column.shard_offset), scalar_int(column.partial)
            for what in _shard_problems(root.world_size, split, shard_offset, partial):
                problem(where, what)
            if layer is not None and layer != parsed_layer:
                problem(where, f"attribute 'layer' is {layer} but the name says {parsed_layer}")
            if order is not None and cfg and _order_error(cfg, base, parsed_layer) is None:
                want = _order(cfg, name)
                if order != want:
                    problem(where, f"attribute 'order' is {order} but the vocabulary puts it at {want} for this config")
            if native is not None and native not in NATIVE_DTYPES:
                problem(where, f"attribute 'native_dtype' is \"{native}\", expected {schema.quoted(NATIVE_DTYPES)}")
            if dtype_attr is not None and dtype_attr != schema.BF16_MARK:
                problem(where, f"attribute 'dtype' is \"{dtype_attr}\"; the only value is \"{schema.BF16_MARK}\" (on uint16 data)")
            if name == "tokens":
                if layout is not None and layout != kind.layout:
                    problem(where, f"attribute 'layout' is \"{layout}\", expected \"{kind.layout}\"")
                if order is not None and order != 0:
                    problem(where, f"attribute 'order' is {order}, expected 0")
                continue
            t = ds.id.get_type()
            p = _float_problem(ds)
            if p:
                problem(where, p)
            if t.get_class() == h5py.h5t.FLOAT and dtype_attr is not None:
                problem(where, "attribute 'dtype' = \"bf16\" on float data (it marks uint16 bf16 bits)")
            elif p is None and t.get_class() == h5py.h5t.INTEGER and dtype_attr is None:
                problem(where, "is uint16 without the attribute dtype = \"bf16\" (bf16 bits are marked so)")
            if cfg is None:
                continue
            if n_tokens is None or n_kv is None:
                err = _order_error(cfg, base, parsed_layer)
                if err:
                    problem(where, err)
                continue
            rows, kv_rows = n_tokens, n_kv  # with row_offset: rows row_offset.. of T (S for the cache)
            if row_offset is not None:
                total = n_kv if row_letter == schema.CACHE_DIM else n_tokens
                if not 0 <= row_offset < total:
                    what = "cache" if row_letter == schema.CACHE_DIM else "token"
                    problem(where, f"attribute 'row_offset' is {row_offset}, outside the step's {total} {what} rows")
                    continue
                if row_letter == schema.CACHE_DIM:
                    kv_rows = n_kv - row_offset
                else:
                    rows = n_tokens - row_offset
            shard_cfg = cfg
            if split is not None and row_kind is not None:
                shard_cfg, what = _shard_config(cfg, list(row_kind.dims), split, shard_offset or 0,
                                                tuple(ds.shape), rows, kv_rows)
                if shard_cfg is None:
                    problem(where, what)
                    continue
            p = check_checkpoint(shard_cfg, name, parsed_layer, tuple(ds.shape), layout or "", rows, kv_rows)
            if p:
                problem(where, p)
                continue
            kind = vocabulary.find_kind(base)
            canonical = tuple(cfg.size(d, rows, kv_rows) for d in kind.dims)
            if layout is None and tuple(ds.shape) == canonical:
                n_past = n_kv - n_tokens + (row_offset if row_offset is not None and row_letter is not None else 0)
                wrong, warn = _layout_ambiguity(ds, base, list(kind.dims), tuple(ds.shape), n_past)
                if wrong:
                    problem(where, wrong)
                if warn:
                    if warn in ambiguous:
                        ambiguous[warn][1] += 1
                    else:
                        ambiguous[warn] = [where, 0]
        for warn, (first, more) in ambiguous.items():
            what = warn + (f" (and {more} more dataset{'' if more == 1 else 's'} of this step)" if more else "")
            result.warnings.append(Problem(first, what))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diffrun.validate",
                                 description="Check a dump against docs/dump-format.md (every problem at once)")
    ap.add_argument("dump")
    ap.add_argument("--json", action="store_true", help="as JSON")
    args = ap.parse_args(argv)
    try:
        r = validate(args.dump)
    except DumpFormatError as e:
        print(f"diffrun.validate: {e}", file=sys.stderr)
        return 2
    except (OSError, KeyError, ValueError, TypeError, RuntimeError, UnicodeError, MemoryError) as e:
        # h5py's errors on a missing, foreign or damaged file: one line naming the file, not a traceback
        what = " ".join(str(e).split()) or type(e).__name__
        print(f"diffrun.validate: {args.dump}: cannot be read ({type(e).__name__}: {what[:300]})", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"path": args.dump, "valid": r.valid, "steps": r.n_steps, "datasets": r.n_datasets,
                          "problems": [{"where": p.where, "what": p.what} for p in r.problems],
                          "warnings": [{"where": w.where, "what": w.what} for w in r.warnings]}, indent=2))
    else:
        for p in r.problems:
            print(f"{args.dump}: {p.where}: {p.what}")
        for w in r.warnings:
            print(f"{args.dump}: {w.where}: warning: {w.what}")
        if r.valid:
            print(f"{args.dump}: valid diffrun dump ({r.n_steps} steps, {r.n_datasets} datasets)")
        else:
            print(f"{args.dump}: {len(r.problems)} problem{'' if len(r.problems) == 1 else 's'}")
    return 0 if r.valid else 1


if __name__ == "__main__":
    sys.exit(main())
