"""Checks a dump against docs/dump-format.md and lists every problem at once: the twin of `diffrun validate`
(checkpoints/dump_validate.cpp), with the same checks and the same wording.

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

from . import vocabulary
from .dump import (ATTRIBUTE_TABLE, FORMAT_VERSIONS, DumpFormatError, link_refusal, read_attribute_table,
                   storage_refusal)

# (name, type, required, enum values)
ROOT_ATTRIBUTES: list[tuple[str, str, bool, str | None]] = [
    ("format", "string", True, "diffrun-dump"),
    ("format_version", "integer", True, None),
    ("backend", "string", True, None),
    ("precision", "string", True, "f16|bf16|f32|f64"),
    ("model_path", "string", True, None),
    ("model_fingerprint", "string", True, None),
    ("arch", "string", True, "llama|qwen2|qwen3|gemma3"),
    ("n_layer", "integer", True, None),
    ("n_embd", "integer", True, None),
    ("n_head", "integer", True, None),
    ("n_head_kv", "integer", True, None),
    ("head_dim", "integer", True, None),
    ("n_ff", "integer", True, None),
    ("n_vocab", "integer", True, None),
    ("n_ctx", "integer", True, None),
    ("rope_theta", "real", True, None),
    ("rope_type", "string", True, "norm|neox"),
    ("rms_eps", "real", True, None),
    ("tied_output", "boolean", True, None),
    ("qkv_bias", "boolean", True, None),
    ("qk_norm", "boolean", True, None),
    ("prompt", "string", True, None),
    ("token_ids", "int_array", True, None),
    ("created_utc", "string", True, None),
    ("diffrun_version", "string", True, None),
    ("all_token_ids", "int_array", False, None),
    ("argmax", "int_array", False, None),
]
NATIVE_DTYPES = ("f32", "f64", "f16", "bf16", "i32")
INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
# The most layers a dump may declare: the readers' kMaxLayers (checkpoints/dump.cpp). Every name list is sized by
# n_layer, so a dump declaring 2e9 layers would exhaust memory before anything else is checked.
MAX_LAYERS = 4096


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
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    qk_norm: bool

    def size(self, letter: str, n_tokens: int, n_kv: int) -> int:
        return {"T": n_tokens, "S": n_kv, "D": self.n_embd, "H": self.n_head, "Hkv": self.n_head_kv,
                "Dh": self.head_dim, "F": self.n_ff, "V": self.n_vocab}[letter]


# --- HDF5 attribute inspection -------------------------------------------------------------------------------

_CLASS_TEXT = {
    h5py.h5t.INTEGER: "an integer", h5py.h5t.FLOAT: "a float", h5py.h5t.STRING: "a string",
    h5py.h5t.ENUM: "an enum", h5py.h5t.COMPOUND: "a compound", h5py.h5t.ARRAY: "an array type",
    h5py.h5t.OPAQUE: "an opaque type", h5py.h5t.VLEN: "a variable-length sequence",
    h5py.h5t.BITFIELD: "a bitfield", h5py.h5t.REFERENCE: "a reference",
}


def _class_text(cls: int) -> str:
    return _CLASS_TEXT.get(cls, "an unknown type")


@dataclass
class _AttrShape:
    exists: bool = False
    cls: int = -1
    rank: int = 0
    n: int = 0
    vlen: bool = False  # a variable-length string


def _inspect(obj: Any, name: str) -> _AttrShape:
    if name not in obj.attrs:
        return _AttrShape()
    a = h5py.h5a.open(obj.id, name.encode())
    t, space = a.get_type(), a.get_space()
    rank = space.get_simple_extent_ndims() if space.get_simple_extent_type() != h5py.h5s.NULL else 0
    vlen = t.get_class() == h5py.h5t.STRING and t.is_variable_str()
    return _AttrShape(True, t.get_class(), rank, int(space.get_select_npoints()), vlen)


def _read(obj: Any, name: str) -> Any:
    try:
        return obj.attrs[name]
    except (OSError, TypeError, ValueError, KeyError):
        return None


def _read_string(obj: Any, name: str) -> str | None:
    v = _read(obj, name)
    if isinstance(v, np.ndarray) and v.size == 1:
        v = v.reshape(-1)[0]
    if isinstance(v, bytes):
        return v.split(b"\0", 1)[0].decode("utf-8", "replace")
    return v if isinstance(v, str) else None


def _read_ints(obj: Any, name: str) -> list[int] | None:
    v = _read(obj, name)
    if v is None:
        return None
    arr = np.asarray(v)
    if arr.dtype.kind not in "iub":
        return None
    return [int(x) for x in arr.reshape(-1)]


def _read_real(obj: Any, name: str) -> float | None:
    v = _read(obj, name)
    try:
        return float(np.asarray(v).reshape(-1)[0])
    except (TypeError, ValueError, IndexError):
        return None


def _quoted(values: str) -> str:
    parts = values.split("|")
    out = ""
    for i, v in enumerate(parts):
        out += ("" if i == 0 else " or " if i + 1 == len(parts) else ", ") + f'"{v}"'
    return out


def _expected(kind: str, values: str | None) -> str:
    return {
        "string": ("a string: " + _quoted(values)) if values else "a string",
        "integer": "an int32 scalar",
        "real": "a float64 scalar",
        "boolean": "a boolean (h5py bool, or an integer 0/1)",
        "int_array": "a 1-D int32 array",
    }[kind]


def _type_problem(kind: str, values: str | None, s: _AttrShape) -> str:
    got = "is " + _class_text(s.cls)
    scalar = s.n == 1 and s.rank <= 1
    classes = {"string": (h5py.h5t.STRING,), "integer": (h5py.h5t.INTEGER,),
               "real": (h5py.h5t.FLOAT, h5py.h5t.INTEGER), "boolean": (h5py.h5t.ENUM, h5py.h5t.INTEGER),
               "int_array": (h5py.h5t.INTEGER,)}[kind]
    if s.cls not in classes:
        return got + ", expected " + _expected(kind, values)
    if kind == "int_array":
        return "" if s.rank == 1 else f"has rank {s.rank}, expected " + _expected(kind, values)
    if not scalar:
        return f"holds {s.n} strings, expected one" if kind == "string" else f"holds {s.n} values, expected one"
    return ""


# --- root attributes -----------------------------------------------------------------------------------------

@dataclass
class _Root:
    problems: list[Problem] = field(default_factory=list)
    config: _Config | None = None
    token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] | None = None
    argmax: list[int] | None = None
    format_version: int = 0  # 0: unknown (missing or unreadable)


def _check_root(f: h5py.File) -> _Root:
    r = _Root()

    def problem(name: str, what: str) -> None:
        r.problems.append(Problem(f"root attribute '{name}'", what))

    strings: dict[str, str] = {}
    ints: dict[str, int] = {}
    reals: dict[str, float] = {}
    arrays: dict[str, list[int]] = {}
    # The version first: from version 2 on strings are fixed-length, and a variable-length one is
    # reported without being read (HDF5 1.10 crashes on some damaged global heaps).
    s = _inspect(f, "format_version")
    if s.exists and s.cls == h5py.h5t.INTEGER and s.n == 1:
        v = _read_ints(f, "format_version")
        if v and len(v) == 1 and 1 <= v[0] <= INT32_MAX:
            r.format_version = v[0]
    for name, kind, required, values in ROOT_ATTRIBUTES:
        s = _inspect(f, name)
        if not s.exists:
            if required:
                problem(name, f"missing ({_expected(kind, values)})")
            continue
        p = _type_problem(kind, values, s)
        if p:
            problem(name, p)
            continue
        if s.vlen and r.format_version >= 2:
            problem(name, f"is a variable-length string; format version {r.format_version} stores fixed-length strings")
            continue
        if kind == "string":
            v = _read_string(f, name)
            if v is None:
                problem(name, "cannot be read as a string")
            elif values and v not in values.split("|"):
                problem(name, f'is "{v}", expected {_quoted(values)}')
            elif name == "backend" and not v:
                problem(name, "is empty (name the engine that wrote the dump)")
            else:
                strings[name] = v
        elif kind in ("integer", "boolean"):
            v = _read_ints(f, name)
            if v is None or len(v) != 1:
                problem(name, "cannot be read as an integer")
                continue
            x = v[0]
            if kind == "boolean" and x not in (0, 1):
                problem(name, f"is {x}, expected a boolean (0 or 1)")
            elif kind == "integer" and not INT32_MIN <= x <= INT32_MAX:
                problem(name, f"is {x}, outside int32")
            else:
                ints[name] = x
        elif kind == "real":
            v = _read_real(f, name)
            if v is None:
                problem(name, "cannot be read as a real")
            else:
                reals[name] = v
        else:
            v = _read_ints(f, name)
            if v is None:
                problem(name, "cannot be read as integers")
            else:
                arrays[name] = v

    if "format_version" in ints and ints["format_version"] not in FORMAT_VERSIONS:
        problem("format_version", f"is {ints['format_version']}, this diffrun reads versions "
                                  f"{FORMAT_VERSIONS[0]} to {FORMAT_VERSIONS[-1]}")

    ok = all(k in strings for k in ("arch", "rope_type")) and all(k in reals for k in ("rope_theta", "rms_eps"))
    for k in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "n_vocab", "n_ctx"):
        if k not in ints:
            ok = False
        elif ints[k] <= 0:
            problem(k, f"is {ints[k]}, expected a positive integer")
            ok = False
        elif k == "n_layer" and ints[k] > MAX_LAYERS:
            problem(k, f"is {ints[k]}, outside 1..{MAX_LAYERS} (no model has more layers; readers refuse it)")
            ok = False
    if any(k not in ints for k in ("tied_output", "qkv_bias", "qk_norm")):
        ok = False
    for k in ("rope_theta", "rms_eps"):
        if k in reals and not reals[k] > 0:
            problem(k, f"is {reals[k]:f}, expected a positive real")
            ok = False
    if ints.get("n_head_kv", 0) > 0 and "n_head" in ints and ints["n_head"] % ints["n_head_kv"] != 0:
        problem("n_head_kv", f"is {ints['n_head_kv']}, which does not divide n_head = {ints['n_head']}")
        ok = False
    if ok:
        r.config = _Config(strings["arch"], ints["n_layer"], ints["n_embd"], ints["n_head"], ints["n_head_kv"],
                           ints["head_dim"], ints["n_ff"], ints["n_vocab"], ints["qk_norm"] != 0)

    def ids(k: str) -> list[int] | None:
        if k not in arrays:
            return None
        for x in arrays[k]:
            if x < 0 or (r.config and x >= r.config.n_vocab):
                top = str(r.config.n_vocab - 1) if r.config else "n_vocab-1"
                problem(k, f"holds id {x}, outside the vocabulary 0..{top}")
                return None
        return list(arrays[k])

    t = ids("token_ids")
    if t is not None:
        if not t:
            problem("token_ids", "is empty (the prompt has at least one token)")
        r.token_ids = t
    r.all_token_ids = ids("all_token_ids")
    if r.all_token_ids is not None and r.token_ids and (
            len(r.all_token_ids) < len(r.token_ids) or r.all_token_ids[:len(r.token_ids)] != r.token_ids):
        problem("all_token_ids", "does not start with token_ids (it holds the prompt, then one id per decode step)")
    if "argmax" in arrays:
        r.argmax = list(arrays["argmax"])
    return r


# --- checkpoints ---------------------------------------------------------------------------------------------

def _order_error(cfg: _Config, base: str, layer: int) -> str | None:
    """checkpoint_order's InputError text when the name does not exist for this config, else None."""
    kind = vocabulary.find_kind(base)
    name = vocabulary.checkpoint_name(base, layer)
    if kind is None:
        return f"unknown checkpoint '{name}' (not in the checkpoint vocabulary)"
    if base in ("Qnorm", "Knorm") and not cfg.qk_norm:
        return f"checkpoint '{name}' does not exist for architecture {cfg.arch} without per-head q/k norms"
    if base not in ("Qnorm", "Knorm") and cfg.arch not in kind.archs:
        return f"checkpoint '{name}' does not exist for architecture {cfg.arch}"
    if kind.per_layer:
        if layer < 0 or layer >= cfg.n_layer:
            return f"checkpoint '{name}': layer {layer} outside 0..{cfg.n_layer - 1}"
        return None
    if layer >= 0:
        return f"checkpoint '{base}' is not per-layer (got '{name}')"
    return None


def _order(cfg: _Config, name: str) -> int:
    kinds = [k for k in vocabulary.KINDS
             if (cfg.qk_norm if k.base in ("Qnorm", "Knorm") else cfg.arch in k.archs)]
    lead = [k.base for k in kinds if not k.per_layer and k.base in vocabulary._LEADING]
    tail = [k.base for k in kinds if not k.per_layer and k.base not in vocabulary._LEADING]
    names = lead + [vocabulary.checkpoint_name(k.base, L) for L in range(cfg.n_layer) for k in kinds if k.per_layer]
    return (names + tail).index(name)


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
            if dims[i + 1] != "Dh" or dims[i] not in ("H", "Hkv"):
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
    p = np.transpose(x, [names.index(d) for d in ("H", "T", "S")]).astype(np.float64)
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
    dims have the same size (> 1); as layout_ambiguity in checkpoints/dump_validate.cpp."""
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

            def scalar_int(attr: str) -> int | None:
                if v2:
                    return row.get(attr)
                a = _inspect(ds, attr)
                if not a.exists:
                    return None
                if a.cls != h5py.h5t.INTEGER or a.n != 1:
                    problem(where, f"attribute '{attr}' is {_class_text(a.cls)}{' array' if a.n != 1 else ''}, "
                                   "expected a scalar integer")
                    return None
                v = _read_ints(ds, attr)
                return v[0] if v and len(v) == 1 else None

            def scalar_str(attr: str) -> str | None:
                if v2:
                    return row.get(attr)
                a = _inspect(ds, attr)
                if not a.exists:
                    return None
                if a.cls != h5py.h5t.STRING or a.n != 1:
                    problem(where, f"attribute '{attr}' is {_class_text(a.cls)}, expected a string")
                    return None
                return _read_string(ds, attr)

            order, layer = scalar_int("order"), scalar_int("layer")
            row_offset = scalar_int("row_offset")
            row_kind = vocabulary.find_kind(base)
            row_letter = None  # the dimension a row_offset counts: T, or S for the cache
            if row_kind is not None and base != "tokens":
                row_letter = "S" if row_kind.dims[0] == "S" else ("T" if "T" in row_kind.dims else None)
            if row_offset is not None and row_letter is None:
                problem(where, "attribute 'row_offset' is only for checkpoints with token or cache rows (kq_soft_max, "
                               "result_output, cache_k, per-token checkpoints)")
                row_offset = None
            layout, native, dtype_attr = scalar_str("layout"), scalar_str("native_dtype"), scalar_str("dtype")
            if layer is not None and layer != parsed_layer:
                problem(where, f"attribute 'layer' is {layer} but the name says {parsed_layer}")
            if order is not None and cfg and _order_error(cfg, base, parsed_layer) is None:
                want = _order(cfg, name)
                if order != want:
                    problem(where, f"attribute 'order' is {order} but the vocabulary puts it at {want} for this config")
            if native is not None and native not in NATIVE_DTYPES:
                problem(where, f"attribute 'native_dtype' is \"{native}\", expected \"f16\", \"bf16\", \"f32\", "
                               "\"f64\" or \"i32\"")
            if dtype_attr is not None and dtype_attr != "bf16":
                problem(where, f"attribute 'dtype' is \"{dtype_attr}\"; the only value is \"bf16\" (on uint16 data)")
            if name == "tokens":
                if layout is not None and layout != "T":
                    problem(where, f"attribute 'layout' is \"{layout}\", expected \"T\"")
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
                total = n_kv if row_letter == "S" else n_tokens
                if not 0 <= row_offset < total:
                    what = "cache" if row_letter == "S" else "token"
                    problem(where, f"attribute 'row_offset' is {row_offset}, outside the step's {total} {what} rows")
                    continue
                if row_letter == "S":
                    kv_rows = n_kv - row_offset
                else:
                    rows = n_tokens - row_offset
            p = check_checkpoint(cfg, name, parsed_layer, tuple(ds.shape), layout or "", rows, kv_rows)
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
