"""The Python package's one reader of HDF5 attributes (root attributes, version-1 dataset attributes): what an
attribute is without reading it, and its value as a string, integers or a real. diffrun.dump and diffrun.validate
read through it; the C++ side has its twin in dump/dump_format.cpp (h5::inspect_attribute and friends).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

_CLASS_TEXT = {
    h5py.h5t.INTEGER: "an integer", h5py.h5t.FLOAT: "a float", h5py.h5t.STRING: "a string",
    h5py.h5t.ENUM: "an enum", h5py.h5t.COMPOUND: "a compound", h5py.h5t.ARRAY: "an array type",
    h5py.h5t.OPAQUE: "an opaque type", h5py.h5t.VLEN: "a variable-length sequence",
    h5py.h5t.BITFIELD: "a bitfield", h5py.h5t.REFERENCE: "a reference",
}

# The HDF5 classes each attribute type of the schema accepts (docs/dump-format.md, "Types").
ACCEPTED_CLASSES = {"string": (h5py.h5t.STRING,), "integer": (h5py.h5t.INTEGER,),
                    "real": (h5py.h5t.FLOAT, h5py.h5t.INTEGER), "boolean": (h5py.h5t.ENUM, h5py.h5t.INTEGER),
                    "integer array": (h5py.h5t.INTEGER,)}


def class_text(cls: int) -> str:
    """'an integer', 'a string', ... for an HDF5 type class."""
    return _CLASS_TEXT.get(cls, "an unknown type")


@dataclass
class Shape:
    """What one attribute is, without reading it."""
    exists: bool = False
    cls: int = -1
    rank: int = 0
    n: int = 0
    vlen: bool = False  # a variable-length string


def inspect(obj: Any, name: str) -> Shape:
    if name not in obj.attrs:
        return Shape()
    a = h5py.h5a.open(obj.id, name.encode())
    t, space = a.get_type(), a.get_space()
    rank = space.get_simple_extent_ndims() if space.get_simple_extent_type() != h5py.h5s.NULL else 0
    vlen = t.get_class() == h5py.h5t.STRING and t.is_variable_str()
    return Shape(True, t.get_class(), rank, int(space.get_select_npoints()), vlen)


def plain(value: Any) -> Any:
    """numpy scalars and bytes to Python values; arrays stay numpy arrays."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.generic):
        return value.item()
    return value


def read(obj: Any, name: str) -> Any:
    """The attribute as h5py gives it, or None when it cannot be read."""
    try:
        return obj.attrs[name]
    except (OSError, TypeError, ValueError, KeyError):
        return None


def read_string(obj: Any, name: str) -> str | None:
    v = read(obj, name)
    if isinstance(v, np.ndarray) and v.size == 1:
        v = v.reshape(-1)[0]
    if isinstance(v, bytes):
        return v.split(b"\0", 1)[0].decode("utf-8", "replace")
    return v if isinstance(v, str) else None


def read_ints(obj: Any, name: str) -> list[int] | None:
    v = read(obj, name)
    if v is None:
        return None
    arr = np.asarray(v)
    if arr.dtype.kind not in "iub":
        return None
    return [int(x) for x in arr.reshape(-1)]


def read_real(obj: Any, name: str) -> float | None:
    v = read(obj, name)
    try:
        return float(np.asarray(v).reshape(-1)[0])
    except (TypeError, ValueError, IndexError):
        return None


def variable_length_strings(obj: Any) -> list[str]:
    """The names of the attributes of `obj` that are variable-length strings, found without reading them."""
    out = []
    for k in obj.attrs:
        dt = obj.attrs.get_id(k).dtype
        if dt.kind == "O" and h5py.check_string_dtype(dt) is not None:
            out.append(k)
    return out


def read_all(obj: Any) -> dict[str, Any]:
    """Every attribute of `obj` as plain Python values (strings decoded, numpy scalars unwrapped)."""
    return {k: plain(v) for k, v in obj.attrs.items()}
