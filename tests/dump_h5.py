"""Plain-h5py access to diffrun dumps for the tests (docs/dump-format.md, version 2): the per-step
attribute table `_attributes` as dicts, edits of it, fixed-length root strings, and the old version-1
form (per-dataset attributes, variable-length strings) made from a version-2 dump."""
from __future__ import annotations

import h5py
import numpy as np

ABSENT = -(2**31)  # an integer column's "absent"
TABLE = "_attributes"
STRING_COLUMNS = ("name", "layout", "native_dtype", "dtype")
INT_COLUMNS = ("order", "layer", "row_offset")
COLUMNS = ("name", "order", "layer", "layout", "native_dtype", "row_offset", "dtype")


def fixed(value: str) -> np.ndarray:
    """A scalar fixed-length UTF-8 string sized to the value, as diffrun writes root strings."""
    b = str(value).encode("utf-8")
    return np.array(b, dtype=h5py.string_dtype("utf-8", max(1, len(b))))


def text(value) -> str:
    """A string attribute as str (fixed-length ones come back from h5py as bytes)."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def table(group: h5py.Group) -> dict[str, dict]:
    """{dataset name: {attribute: value}} of a step group, absent attributes left out (the table as
    a numpy structured array, read with plain h5py)."""
    if TABLE not in group:
        return {}
    t = group[TABLE][()]
    out = {}
    for row in t:
        a = {}
        for col in t.dtype.names:
            v = row[col]
            if isinstance(v, bytes):
                if v:
                    a[col] = v.decode("utf-8")
            elif int(v) != ABSENT:
                a[col] = int(v)
        out[a.pop("name")] = a
    return out


def attrs(f: h5py.File, step: int, name: str) -> dict:
    """The attributes of dataset `name` of a step ({} when it has none)."""
    return table(f[f"step_{step:04d}"]).get(name, {})


def write_table(group: h5py.Group, rows: dict[str, dict]) -> None:
    """Replaces a step's attribute table with `rows` ({name: {attribute: value}}), strings sized to
    each column's longest value."""
    if TABLE in group:
        del group[TABLE]
    enc = [(n.encode("utf-8"), {k: (v.encode("utf-8") if isinstance(v, str) else v) for k, v in a.items()})
           for n, a in rows.items()]
    width = {c: max([1] + [len(n) if c == "name" else len(a.get(c, b"")) for n, a in enc]) for c in STRING_COLUMNS}
    dtype = np.dtype([(c, f"S{width[c]}" if c in STRING_COLUMNS else "<i4") for c in COLUMNS])
    data = np.zeros(len(enc), dtype=dtype)
    for i, (n, a) in enumerate(enc):
        data[i] = tuple(n if c == "name" else a.get(c, b"" if c in STRING_COLUMNS else ABSENT) for c in COLUMNS)
    group.create_dataset(TABLE, data=data)


def set_attr(group: h5py.Group, name: str, key: str, value) -> None:
    """Sets (value not None) or removes (None) one attribute of dataset `name` in the step's table."""
    rows = table(group)
    a = rows.setdefault(name, {})
    if value is None:
        a.pop(key, None)
    else:
        a[key] = value
    write_table(group, rows)


def rename(group: h5py.Group, old: str, new: str) -> None:
    """Renames a dataset and its table row."""
    group.move(old, new)
    rows = table(group)
    if old in rows:
        rows[new] = rows.pop(old)
    write_table(group, rows)


def to_version_1(path) -> None:
    """Rewrites a version-2 dump in place in the version-1 form: format_version 1, root strings
    variable-length, each dataset's attributes as HDF5 attributes of the dataset (strings
    variable-length), no attribute tables."""
    vlen = h5py.string_dtype("utf-8")
    with h5py.File(path, "r+") as f:
        for k in list(f.attrs):
            v = f.attrs[k]
            if isinstance(v, bytes):
                del f.attrs[k]
                f.attrs.create(k, v.decode("utf-8"), dtype=vlen)
        f.attrs["format_version"] = np.int32(1)
        for gname in [k for k in f if k.startswith("step_")]:
            g = f[gname]
            for name, a in table(g).items():
                ds = g[name]
                for k, v in a.items():
                    if isinstance(v, str):
                        ds.attrs.create(k, v, dtype=vlen)
                    else:
                        ds.attrs.create(k, np.int32(v))
            if TABLE in g:
                del g[TABLE]
