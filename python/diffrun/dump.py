"""Reader for diffrun dumps (HDF5, format "diffrun-dump"): metadata, steps, names, tensors on demand."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from . import attributes, schema, vocabulary
from .schema import attr, column

FORMAT = schema.FORMAT
FORMAT_VERSION = schema.FORMAT_VERSION  # what diffrun.writer writes
FORMAT_VERSIONS = schema.FORMAT_VERSIONS  # what the reader reads
ATTRIBUTE_TABLE = schema.ATTRIBUTE_TABLE  # version 2: a step group's dataset attributes, one compound row per dataset
ABSENT_INT = -(2**31)  # an integer column's value for "absent"
_TABLE_STRINGS = ("name",) + tuple(n for n, a in schema.DATASET_ATTRIBUTES.items() if a.type == "string")
_TABLE_INTS = tuple(n for n, a in schema.DATASET_ATTRIBUTES.items() if a.type == "integer")

_STEP_RE = re.compile(r"^step_(\d+)$")


class DumpFormatError(Exception):
    """A file that is not a readable diffrun dump; the message names the file (and dataset)."""

    def __init__(self, path: str, what: str, dataset: str | None = None):
        self.path = path
        self.dataset = dataset
        where = f"{path}: dataset '{dataset}': " if dataset else f"{path}: "
        super().__init__(where + what)


@dataclass(frozen=True)
class DatasetInfo:
    step: int
    name: str
    order: int
    layer: int
    layout: str
    native_dtype: str
    shape: tuple[int, ...]
    dtype: np.dtype
    # How the array is stored when it differs from layout/shape above (the vocabulary's), which get()
    # returns: a [T, H*Dh] per-head array, or a layout attribute that permutes the vocabulary's letters.
    stored_layout: str | None = None
    stored_shape: tuple[int, ...] | None = None
    # A checkpoint recorded for its last rows only (docs/dump-format.md, "Rows"): it holds rows
    # row_offset.. of its row dimension (T; S for cache_k/cache_v) and shape counts those, e.g.
    # kq_soft_max [H, T - row_offset, S]. A cache holding the rows its step wrote comes back whole
    # ([S, Hkv, Dh], row_offset 0) when the steps before it hold the other rows.
    row_offset: int = 0

    @property
    def dims(self) -> list[str]:
        return self.layout.split(",")


_plain = attributes.plain


def _text(b: bytes | str) -> str:
    return b.decode("utf-8", "backslashreplace") if isinstance(b, bytes) else str(b)


def link_refusal(group: h5py.Group, name: str) -> str | None:
    """Why a reader must not follow the link `name` of `group` (docs/dump-format.md, "What readers
    refuse"), or None for a hard link. Reads the link only, never its target: an external link to a
    FIFO would block the open, one to another file would read that file as the dump's."""
    links = group.id.links
    key = name.encode("utf-8")
    kind = links.get_info(key).type
    if kind == h5py.h5l.TYPE_HARD:
        return None
    if kind == h5py.h5l.TYPE_SOFT:
        return f"is a soft link (to '{_text(links.get_val(key))}'); a dump holds no links, readers refuse them"
    if kind == h5py.h5l.TYPE_EXTERNAL:
        file, obj = links.get_val(key)
        return (f"is an external link (to '{_text(file)}', object '{_text(obj)}'): a dump holds its data itself, "
                "readers refuse links to other files")
    return f"is a user-defined link (type {kind}); a dump holds no links, readers refuse them"


def storage_refusal(ds: h5py.Dataset) -> str | None:
    """Why the data of a dataset must not be read, or None: HDF5 external storage (its bytes in
    another file, e.g. /etc/passwd) or a virtual dataset (its data in other datasets or files)."""
    dcpl = ds.id.get_create_plist()
    if dcpl.get_external_count() > 0:
        return (f"stores its data in the external file '{_text(dcpl.get_external(0)[0])}' (HDF5 external storage): "
                "a dump holds its data itself, readers refuse it")
    if dcpl.get_layout() == h5py.h5d.VIRTUAL:
        return ("is a virtual dataset (its data lives in other datasets or files): a dump holds its data itself, "
                "readers refuse it")
    return None


def read_attribute_table(group: h5py.Group, where: str) -> dict[str, dict[str, Any]]:
    """A version-2 step group's attribute table as {dataset name: {attribute: value}}, absent
    attributes left out. Raises ValueError naming what is wrong; {} when the group has none."""
    if ATTRIBUTE_TABLE not in list(group.keys()):  # the names only: `in group` would follow a link
        return {}
    refused = link_refusal(group, ATTRIBUTE_TABLE)
    if refused:
        raise ValueError(f"{where}: {refused}")
    ds = group[ATTRIBUTE_TABLE]
    refused = storage_refusal(ds) if isinstance(ds, h5py.Dataset) else None
    if refused:
        raise ValueError(f"{where}: {refused}")
    if not isinstance(ds, h5py.Dataset) or ds.dtype.names is None or ds.ndim != 1:
        raise ValueError(f"{where}: not a 1-D compound dataset (one row per dataset of the step)")
    fields = ds.dtype.fields
    if "name" not in fields:
        raise ValueError(f"{where}: has no column 'name'")
    for col in _TABLE_STRINGS + _TABLE_INTS:
        if col not in fields:
            continue
        dt = fields[col][0]
        if col in _TABLE_STRINGS and dt.kind != "S":
            what = "a variable-length string" if h5py.check_string_dtype(dt) else f"{dt}"
            raise ValueError(f"{where}: column '{col}' is {what}, expected a fixed-length string")
        if col in _TABLE_INTS and dt.kind not in "iu":
            raise ValueError(f"{where}: column '{col}' is {dt}, expected an integer")
    rows = ds[()]
    table: dict[str, dict[str, Any]] = {}
    for row in rows:
        attrs: dict[str, Any] = {}
        for col in _TABLE_STRINGS:
            if col in fields and row[col]:
                attrs[col] = bytes(row[col]).decode("utf-8")
        for col in _TABLE_INTS:
            if col in fields and int(row[col]) != ABSENT_INT:
                attrs[col] = int(row[col])
        name = attrs.pop("name", "")
        if not name:
            raise ValueError(f"{where}: a row without a name")
        if name in table:
            raise ValueError(f"{where}: names '{name}' twice")
        table[name] = attrs
    return table


def _stored_dtype_name(ds: h5py.Dataset, attrs: Any = None) -> str:
    """f32, f64, f16, i32 ..., and bf16 for 16-bit data marked with the attribute dtype = "bf16"."""
    attrs = ds.attrs if attrs is None else attrs
    if ds.dtype.itemsize == 2 and ds.dtype.kind in "uiV" and _plain(attrs.get(column.dtype, "")) == schema.BF16_MARK:
        return "bf16"
    return {"f": "f", "i": "i", "u": "u"}.get(ds.dtype.kind, "x") + str(8 * ds.dtype.itemsize)


def _group_name(step: int) -> str:
    return f"step_{step:04d}"


class Dump:
    """An open dump. Tensors are read only when asked for (get); use as a context manager or close()."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise DumpFormatError(self.path, "no such file")
        try:
            self._file = h5py.File(self.path, "r")
        except OSError as e:
            raise DumpFormatError(self.path, f"not a readable HDF5 file (foreign or truncated): {e}") from None
        try:
            self.meta: dict[str, Any] = self._read_meta()
            self._steps = self._find_steps()
            self._refuse_links()
        except BaseException:
            self._file.close()
            raise
        self._infos: dict[int, list[DatasetInfo]] = {}
        self._tables: dict[int, dict[str, dict[str, Any]]] = {}

    def _read_meta(self) -> dict[str, Any]:
        try:
            # From version 2 on strings are fixed-length: a variable-length one is refused before it is
            # read (HDF5 1.10 crashes on some damaged global heaps).
            version = self._file.attrs.get(attr.format_version) if attr.format_version in self._file.attrs else None
            if isinstance(version, (int, np.integer)) and version >= 2:
                for k in attributes.variable_length_strings(self._file)[:1]:
                    raise DumpFormatError(
                        self.path,
                        f"root attribute '{k}' is a variable-length string; format version {int(version)} "
                        "stores fixed-length strings")
            attrs = attributes.read_all(self._file)
        except (OSError, KeyError) as e:
            raise DumpFormatError(self.path, f"cannot read root attributes: {e}") from None
        fmt = attrs.get(attr.format)
        if fmt is None:
            raise DumpFormatError(self.path, "not a diffrun dump (no 'format' root attribute)")
        if fmt != FORMAT:
            raise DumpFormatError(self.path, f"not a diffrun dump (format is '{fmt}', expected '{FORMAT}')")
        version = attrs.get(attr.format_version)
        if version not in FORMAT_VERSIONS:
            raise DumpFormatError(
                self.path,
                f"format_version {version} is not supported (this reader reads versions "
                f"{FORMAT_VERSIONS[0]} to {FORMAT_VERSIONS[-1]})",
            )
        return attrs

    def _attrs(self, step: int, name: str) -> Any:
        """The attributes of dataset `name` of a step: its row of the step's attribute table (version
        2), else the dataset's own attributes (version 1)."""
        if self.meta.get(attr.format_version, 1) < 2:
            return attributes.read_all(self._file[f"{_group_name(step)}/{name}"])
        if step not in self._tables:
            where = f"{_group_name(step)}/{ATTRIBUTE_TABLE}"
            try:
                table = read_attribute_table(self._group(step), where)
            except (ValueError, OSError) as e:
                raise DumpFormatError(self.path, str(e)) from None
            self._tables[step] = table  # rows naming no dataset of the step are ignored (validate reports them)
        return self._tables[step].get(name, {})

    def _find_steps(self) -> list[int]:
        steps = []
        for key in self._file.keys():
            m = _STEP_RE.match(key)
            if m:
                steps.append(int(m.group(1)))
        return sorted(steps)

    def _refuse_links(self) -> None:
        """Every link of the root and of each step group is checked before anything follows it
        (docs/dump-format.md, "What readers refuse")."""
        for key in list(self._file.keys()):
            refused = link_refusal(self._file, key)
            if refused:
                raise DumpFormatError(self.path, f"'{key}' {refused}")
        for step in self._steps:
            group = self._file[_group_name(step)]
            if not isinstance(group, h5py.Group):
                continue
            for name in list(group.keys()):
                refused = link_refusal(group, name)
                if refused:
                    raise DumpFormatError(self.path, refused, f"{_group_name(step)}/{name}")

    def _group(self, step: int) -> h5py.Group:
        if step not in self._steps:
            raise DumpFormatError(self.path, f"no step {step} (steps: {self._steps})", _group_name(step))
        return self._file[_group_name(step)]

    def _infos_of(self, step: int) -> list[DatasetInfo]:
        if step not in self._infos:
            group = self._group(step)
            infos = []
            for name in list(group.keys()):
                ds = group[name]  # a hard link: _refuse_links checked every link at open
                where = f"{_group_name(step)}/{name}"
                if not isinstance(ds, h5py.Dataset) or (name == ATTRIBUTE_TABLE and self.meta[attr.format_version] >= 2):
                    continue
                refused = storage_refusal(ds)
                if refused:
                    raise DumpFormatError(self.path, refused, where)
                # order, layer, layout and native_dtype are optional (docs/dump-format.md): absent ones
                # come from the name through the vocabulary, native_dtype from the stored dtype.
                a = self._attrs(step, name)
                base, parsed_layer = vocabulary.parse_name(name)
                kind = vocabulary.find_kind(base)
                order = a.get(column.order)
                if order is None:
                    order = self._vocab_order(name, len(infos))
                layout = _plain(a.get(column.layout, kind.layout if kind else ""))
                shape = tuple(ds.shape)
                stored_layout = stored_shape = None
                if kind is not None and (layout != kind.layout or len(shape) != len(kind.dims)):
                    stored_layout, stored_shape = layout, shape
                    layout, shape = kind.layout, self._canonical_shape(kind, layout, shape, where)
                stored = _stored_dtype_name(ds, a)
                infos.append(
                    DatasetInfo(
                        step=step,
                        name=name,
                        order=int(order),
                        layer=int(a.get(column.layer, parsed_layer)),
                        layout=layout,
                        native_dtype=_plain(a.get(column.native_dtype, stored)),
                        shape=shape,
                        dtype=np.dtype(np.float32) if stored == "bf16" else ds.dtype,
                        stored_layout=stored_layout,
                        stored_shape=stored_shape,
                        row_offset=int(a.get(column.row_offset, 0)),
                    )
                )
            infos = [self._assembled(i) for i in infos]
            infos.sort(key=lambda i: (i.order, i.name))
            self._infos[step] = infos
        return self._infos[step]

    def _cache_pieces(self, info: DatasetInfo) -> list[tuple[int, int, int]] | None:
        """(step, first row, end row) of each earlier step's rows that make cache `info` whole, in row
        order, or None when the earlier steps do not hold them all."""
        pieces = []
        need = info.row_offset
        for step in reversed([s for s in self._steps if s < info.step]):
            if need == 0:
                break
            key = f"{_group_name(step)}/{info.name}"
            ds = self._file.get(key)
            if not isinstance(ds, h5py.Dataset) or ds.ndim != 3:
                return None
            start = int(self._attrs(step, info.name).get(column.row_offset, 0))
            if start + ds.shape[0] < need:
                return None
            pieces.append((step, start, need))
            need = start
        return None if need > 0 else pieces[::-1]

    def _assembled(self, info: DatasetInfo) -> DatasetInfo:
        kind = vocabulary.find_kind(vocabulary.parse_name(info.name)[0]) if info.row_offset > 0 else None
        if kind is None or kind.dims[0] != schema.CACHE_DIM or info.stored_layout is not None or len(info.shape) != 3:
            return info
        if self._cache_pieces(info) is None:
            return info
        return dataclasses.replace(info, shape=(info.row_offset + info.shape[0],) + info.shape[1:], row_offset=0)

    def _canonical_shape(self, kind: vocabulary.Kind, layout: str, shape: tuple[int, ...], where: str):
        """The vocabulary-layout shape of an array stored [T, H*Dh] or in a permuted layout."""
        dims = layout.split(",")
        if sorted(dims) == sorted(kind.dims) and len(dims) == len(shape):
            size = dict(zip(dims, shape))
            return tuple(size[d] for d in kind.dims)
        if len(kind.dims) == 3 and len(shape) == 2 and kind.dims[2] == schema.HEAD_DIM and layout == kind.layout:
            head_dim = int(self.meta.get(attr.head_dim, 0))
            if head_dim > 0 and shape[1] % head_dim == 0:
                return (shape[0], shape[1] // head_dim, head_dim)
        raise DumpFormatError(self.path, f"shape {shape} does not fit layout '{layout}' "
                              f"(the vocabulary's is '{kind.layout}')", where)

    def _vocab_order(self, name: str, fallback: int) -> int:
        """A vocabulary name's execution index for this dump's arch and layer count; names outside the
        vocabulary come after every vocabulary name, in the order they are listed."""
        if not hasattr(self, "_orders"):
            try:
                names = vocabulary.names_for(schema.stated_features(self.meta), int(self.meta[attr.n_layer]))
            except (KeyError, ValueError):
                names = []
            self._orders = {n: i for i, n in enumerate(names)}
        return self._orders.get(name, 1_000_000 + fallback)

    def steps(self) -> list[int]:
        return list(self._steps)

    def names(self, step: int = 0) -> list[str]:
        """Checkpoint names of a step in recorded execution order."""
        return [i.name for i in self._infos_of(step)]

    def info(self, name: str, step: int = 0) -> DatasetInfo:
        for i in self._infos_of(step):
            if i.name == name:
                return i
        raise DumpFormatError(self.path, "no such dataset", f"{_group_name(step)}/{name}")

    def get(self, name: str, step: int = 0) -> np.ndarray:
        """The checkpoint as a numpy array in its stored dtype (float32 as diffrun writes it, int32 for ids;
        bf16 comes back as float32), read from disk now, in the vocabulary's layout: a per-head checkpoint
        stored [T, H*Dh] comes back [T, H, Dh], a permuted layout (e.g. "H,T,Dh") is permuted back."""
        info = self.info(name, step)
        stored_offset = int(self._attrs(step, name).get(column.row_offset, 0))
        if stored_offset > info.row_offset:
            # a cache put back together: rows start..end-1 of each earlier step, then this step's
            pieces = self._cache_pieces(dataclasses.replace(info, row_offset=stored_offset)) or []
            parts = [self._stored(name, s)[: end - start] for s, start, end in pieces]
            parts.append(self._stored(name, step))
            return np.concatenate(parts, axis=0)
        return self._stored(name, step)

    def _stored(self, name: str, step: int) -> np.ndarray:
        """The rows a dataset holds, in the vocabulary's layout."""
        info = self.info(name, step)
        where = f"{_group_name(step)}/{name}"
        try:
            ds = self._file[where]
            data = ds[()]
            if _stored_dtype_name(ds, self._attrs(step, name)) == "bf16":
                data = (data.astype(np.uint32) << 16).view(np.float32)
        except (OSError, KeyError) as e:
            raise DumpFormatError(self.path, f"cannot read: {e}", where) from None
        if info.stored_layout is not None:
            stored = info.stored_layout.split(",")
            if len(stored) == data.ndim and stored != info.dims:
                data = np.ascontiguousarray(data.transpose([stored.index(d) for d in info.dims]))
            data = data.reshape(info.shape)
        return data

    @property
    def closed(self) -> bool:
        return not self._file.id.valid

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "Dump":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Dump({self.path!r}, backend={self.meta.get(attr.backend)!r}, precision={self.meta.get(attr.precision)!r}, "
            f"steps={len(self._steps)})"
        )


def open(path: str | os.PathLike[str]):  # noqa: A001 - the package's entry point is diffrun.open
    """Opens a dump; raises DumpFormatError naming the file when it is not a readable diffrun dump. A
    directory is a tensor-parallel run's rank dumps, read as one (diffrun.shards.RankDumps)."""
    if os.path.isdir(os.fspath(path)):
        from .shards import open_ranks
        return open_ranks(path)
    return Dump(path)
