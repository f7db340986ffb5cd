"""Writer of diffrun dumps (HDF5, format "diffrun-dump"), the Python twin of dump/dump.cpp's DumpWriter.

    import diffrun
    with diffrun.writer.open("mine.h5", backend="mine", precision="f32", like="reference.h5") as w:
        for step in range(n_steps):
            w.step(step)
            w.put("tokens", ids)                  # int32 [T]
            w.put("attn_norm-0", x)               # float32/float16/float64 arrays, bf16 as uint16 bits
        ...

The writer keeps the C API's contract (capi/dump_writer.cpp), so that what it renames into place is a valid dump:
the root attributes are checked when it opens (every problem in one message; at most MAX_LAYERS layers); steps
are 0, 1, 2, ... in order, each recording "tokens" first (int32 ids inside the vocabulary, step 0's equal to
token_ids, one id per decode step); vocabulary checkpoints fit the config's shapes (T and S from the tokens);
dataset names hold no '/' and are not '.' or '..'. A put or step() that breaks it raises DumpWriteError and
writes nothing; close() refuses to rename a dump without step 0 and removes the temporary instead.

The file is written to PATH.diffrun-tmp-<pid> (created exclusively: a symlink or other file planted at
that name is refused, never written through) and renamed to PATH when the writer closes without an
error; an exception inside the `with` block removes the temporary file, so a half-written dump never
looks whole, and so does SIGTERM while a writer is open (the handler is installed from the main thread
when SIGTERM had its default action). A write that fails (a full disk) raises one DumpWriteError and
removes the temporary. An existing PATH that is not a regular file (a device, a FIFO) is refused.
Values are stored as float32 (exact for f16/bf16; f64 is rounded) with `native_dtype` naming what the
engine computed in, like the C++ writer; keep_dtype=True stores them as given instead (bf16 as uint16
marked dtype = "bf16"). Format version 2: strings are fixed-length, and each step's dataset attributes
(order, layer, layout, native_dtype, row_offset, dtype) are one row each of the step's attribute table
`_attributes`, written when the writer closes.

torch CUDA tensors are put without synchronizing the caller's stream, also inside `torch.cuda.graph` capture
(capture_end() and replay() then record each replay of the graph): see diffrun.cuda_staging.
"""

from __future__ import annotations

import datetime
import os
import signal
import stat
import threading
from typing import Any, Mapping, NoReturn

import h5py
import numpy as np

from . import cuda_staging, schema, vocabulary
from .schema import attr, column, dim
from .dump import ABSENT_INT, ATTRIBUTE_TABLE, FORMAT, FORMAT_VERSION, Dump
from .validate import MAX_LAYERS, _check_root, check_checkpoint

DIFFRUN_VERSION = "0.1.0"

# Root attributes the format requires (dump_schema.json), with their type: str, int (int32), float (float64), bool,
# ids (int32 array).
_WRITTEN_AS = {"string": "str", "integer": "int", "real": "float", "boolean": "bool", "integer array": "ids"}
ROOT_ATTRIBUTES: dict[str, str] = {a.name: _WRITTEN_AS[a.type] for a in schema.ROOT_ATTRIBUTES if a.required}
_WRITTEN: dict[str, str] = {a.name: _WRITTEN_AS[a.type] for a in schema.ROOT_ATTRIBUTES}  # optional ones too
# What a reference dump lends a writer opened with like=: the model and its config (the optional sizes of a
# mixture of experts too), the prompt.
PRECISIONS = schema.ROOT["precision"].values or ()
_FROM_REFERENCE = [k for k in ROOT_ATTRIBUTES
                   if k not in (attr.format, attr.format_version, attr.backend, attr.precision, attr.created_utc,
                                attr.diffrun_version)] + \
    [a for a in schema.DIMS.values() if a and a not in ROOT_ATTRIBUTES]

_NATIVE = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.float64): "f64",
           np.dtype(np.uint16): "bf16", np.dtype(np.int32): "i32"}


def _fixed_str(value: str) -> np.ndarray:
    """A scalar fixed-length UTF-8 string sized to the value (at least 1 byte), as diffrun's C++ writer stores it."""
    b = str(value).encode("utf-8")
    return np.array(b, dtype=h5py.string_dtype("utf-8", max(1, len(b))))


def _table(rows: list[tuple[str, dict[str, Any]]]) -> np.ndarray:
    """A step's attribute table: one row per dataset, strings fixed-length and sized to the column's
    longest value, absent integers ABSENT_INT."""
    enc = [(name, {k: (v.encode("utf-8") if isinstance(v, str) else v) for k, v in a.items()}) for name, a in rows]
    width = {c: max([1] + [len(a.get(c, b"")) for _, a in enc])
             for c in (column.layout, column.native_dtype, column.dtype, column.split)}
    utf8 = lambda n: h5py.string_dtype("utf-8", n)  # noqa: E731 - fixed-length UTF-8, NUL-padded
    # the columns in the order diffrun's C++ writer stores them
    dtype = np.dtype([("name", utf8(max([1] + [len(n.encode("utf-8")) for n, _ in enc]))), (column.order, "<i4"),
                      (column.layer, "<i4"), (column.layout, utf8(width[column.layout])),
                      (column.native_dtype, utf8(width[column.native_dtype])), (column.row_offset, "<i4"),
                      (column.dtype, utf8(width[column.dtype])), (column.split, utf8(width[column.split])),
                      (column.shard_offset, "<i4"), (column.partial, "<i4")])
    table = np.zeros(len(enc), dtype=dtype)
    for i, (name, a) in enumerate(enc):
        table[i] = (name.encode("utf-8"), a.get(column.order, ABSENT_INT), a.get(column.layer, ABSENT_INT),
                    a.get(column.layout, b""), a.get(column.native_dtype, b""), a.get(column.row_offset, ABSENT_INT),
                    a.get(column.dtype, b""), a.get(column.split, b""), a.get(column.shard_offset, ABSENT_INT),
                    a.get(column.partial, ABSENT_INT))
    return table


class DumpWriteError(Exception):
    """A write the format does not allow; the message names the file (and dataset)."""

    def __init__(self, path: str, what: str, dataset: str | None = None):
        where = f"{path}: dataset '{dataset}': " if dataset else f"{path}: "
        super().__init__(where + what)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 values given as their uint16 bit patterns, as float32 (exact)."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bit patterns (uint16), rounded to nearest even, NaN kept NaN."""
    u = np.ascontiguousarray(values, np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


TEMP_INFIX = ".diffrun-tmp-"  # PATH.diffrun-tmp-<pid>, as diffrun's C++ writers name their temporaries

# The temporaries of the open writers, removed by the SIGTERM handler before the signal takes its
# default action again (the process still ends by SIGTERM).
_live_temporaries: dict[int, str] = {}


def _on_sigterm(signum: int, frame: Any) -> None:
    for tmp in list(_live_temporaries.values()):
        try:
            os.unlink(tmp)
        except OSError:
            pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _guard(key: int, tmp: str) -> None:
    _live_temporaries[key] = tmp
    if threading.current_thread() is threading.main_thread():
        try:
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):
            pass


def _unguard(key: int) -> None:
    _live_temporaries.pop(key, None)
    if not _live_temporaries and threading.current_thread() is threading.main_thread():
        try:
            if signal.getsignal(signal.SIGTERM) is _on_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except (ValueError, OSError):
            pass


def _file_kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return what
    return "not a regular file"


def _reason(e: BaseException) -> str:
    """An HDF5 failure in a few words: the system's message when a system call failed."""
    errno_ = getattr(e, "errno", None)
    if errno_:
        return os.strerror(errno_)
    text = str(e)
    if "error message = '" in text:
        return text.split("error message = '", 1)[1].split("'", 1)[0]
    return text.splitlines()[0][:200] if text else type(e).__name__


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Writer:
    """An open dump being written. Use as a context manager, or call close() (abort() drops the file)."""

    def __init__(self, path: str | os.PathLike[str], *, backend: str, precision: str,
                 like: str | os.PathLike[str] | Dump | None = None, meta: Mapping[str, Any] | None = None,
                 keep_dtype: bool = False):
        self.path = os.fspath(path)
        self.keep_dtype = keep_dtype
        attrs: dict[str, Any] = {}
        if like is not None:
            ref = like if isinstance(like, Dump) else Dump(like)
            try:
                attrs.update({k: ref.meta[k] for k in _FROM_REFERENCE if k in ref.meta})
            finally:
                if ref is not like:
                    ref.close()
        attrs.update(meta or {})
        attrs.update(backend=backend, precision=precision, format=FORMAT, format_version=FORMAT_VERSION)
        if not str(backend):
            raise DumpWriteError(self.path, "backend is empty (name the engine that computed the dump)")
        if precision not in PRECISIONS:
            raise DumpWriteError(self.path, f"precision '{precision}' is not one of {', '.join(PRECISIONS)}")
        attrs.setdefault(attr.created_utc, _utc_now())
        attrs.setdefault(attr.diffrun_version, DIFFRUN_VERSION)
        missing = [k for k in ROOT_ATTRIBUTES if k not in attrs]
        if missing:
            raise DumpWriteError(self.path, "missing root attributes " + ", ".join(missing) +
                                 " (pass meta={...} or like=REFERENCE_DUMP)")
        if attrs[attr.arch] not in vocabulary.ALL_ARCHS:
            raise DumpWriteError(self.path, f"unknown arch '{attrs[attr.arch]}' (known: {', '.join(vocabulary.ALL_ARCHS)})")
        # Bounded before anything is sized by it (the names of every layer): the readers' kMaxLayers.
        try:
            n_layer = int(attrs[attr.n_layer])
        except (TypeError, ValueError):
            raise DumpWriteError(self.path, f"root attribute 'n_layer' = {attrs[attr.n_layer]!r} is not an integer") from None
        if not 1 <= n_layer <= MAX_LAYERS:
            raise DumpWriteError(self.path, f"root attribute 'n_layer' is {n_layer}, outside 1..{MAX_LAYERS} (no model "
                                 "has more layers; diffrun's readers refuse such a dump)")
        self.meta = attrs
        self._arch = str(attrs[attr.arch])
        self._n_layer = n_layer
        self._tmp = f"{self.path}{TEMP_INFIX}{os.getpid()}"
        self._file = None
        self._check_target()
        self._file = self._create_temporary()
        _guard(id(self), self._tmp)
        self._step: int | None = None
        self._written: dict[int, list[str]] = {}
        self._tokens: dict[int, int] = {}  # each step's T, once its tokens passed their checks
        self._kv: dict[int, int] = {}  # S after each step: the tokens fed so far
        self._rows: dict[int, list[tuple[str, dict[str, Any]]]] = {}  # each step's attribute table
        self._device: cuda_staging.Staging | None = None  # torch CUDA tensors on their way (put, replay)
        self._write_root(attrs)
        # The root attributes as diffrun validate reads them (the C API checks them when step 0 starts).
        root = _check_root(self._file)
        if root.problems or root.config is None:
            self.abort()
            raise DumpWriteError(self.path, self._root_text(root))
        self._config = root.config
        self._token_ids = list(root.token_ids)
        self._names = vocabulary.names_for(self._config.features, self._n_layer)  # a llama's experts too
        self._order = {n: i for i, n in enumerate(self._names)}

    @staticmethod
    def _root_text(root: Any) -> str:
        problems = root.problems or []
        if not problems:
            return "the root attributes do not describe a model config"
        return (f"the root attributes are not complete ({len(problems)} problem{'' if len(problems) == 1 else 's'}): " +
                "; ".join(f"{p.where}: {p.what}" for p in problems))

    # -- the file --------------------------------------------------------------------------------
    def _check_target(self) -> None:
        """An existing path that is not a regular file is never replaced by the rename (a device
        node, a FIFO, a directory); a symlink to a regular file, or to nothing, is."""
        try:
            st = os.stat(self.path)
        except OSError:
            return
        if not stat.S_ISREG(st.st_mode):
            raise DumpWriteError(self.path, f"exists and is {_file_kind(st.st_mode)}, not a regular file: a dump "
                                 "replaces only a regular file")

    def _create_temporary(self) -> h5py.File:
        """The temporary, created exclusively (HDF5's H5F_ACC_EXCL: O_CREAT | O_EXCL, which fails on any
        existing name, a symlink included). A regular file there is a killed writer's leftover (its pid
        now ours) and is replaced; anything else is refused."""
        try:
            st = os.lstat(self._tmp)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                kind = "a file with other hard links" if stat.S_ISREG(st.st_mode) else _file_kind(st.st_mode)
                raise DumpWriteError(self.path, f"cannot create the temporary '{self._tmp}': it exists and is {kind}, "
                                     "which a dump never writes through (remove it)")
            os.unlink(self._tmp)
        fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
        # Object headers no newer than HDF5 1.10's, so that HDF5 1.10 (the C++ side) reads the file.
        fapl.set_libver_bounds(h5py.h5f.LIBVER_V18, h5py.h5f.LIBVER_V110)
        # No sieve buffer: each dataset's bytes are written by its create_dataset, so a failed write (a
        # full disk) raises there instead of in a later object's deallocation, where h5py can only
        # print it (once per object) and HDF5 can crash at exit.
        fapl.set_sieve_buf_size(0)
        try:
            fid = h5py.h5f.create(os.fsencode(self._tmp), h5py.h5f.ACC_EXCL, fapl=fapl)
        except (OSError, RuntimeError, ValueError) as e:
            raise DumpWriteError(self.path, f"cannot create '{self._tmp}': {_reason(e)}") from None
        f = h5py.File(fid)
        st = os.fstat(f.id.get_vfd_handle())
        self._tmp_id = (st.st_dev, st.st_ino)
        return f

    def _fail(self, e: BaseException, where: str | None = None) -> NoReturn:
        """A write failed (HDF5 or the system): remove the temporary, raise one DumpWriteError."""
        self.abort()
        raise DumpWriteError(self.path, f"cannot write the dump: {_reason(e)}; the temporary "
                             f"'{self._tmp}' was removed", where) from None

    # -- root attributes -------------------------------------------------------------------------
    def _write_root(self, attrs: Mapping[str, Any]) -> None:
        a = self._file.attrs
        for key, value in attrs.items():
            kind = _WRITTEN.get(key)
            try:
                if kind == "str":
                    a.create(key, _fixed_str(value))
                elif kind == "int":
                    a.create(key, np.int32(value))
                elif kind == "float":
                    a.create(key, np.float64(value))
                elif kind == "bool":
                    a.create(key, np.bool_(bool(value)))
                elif kind == "ids":
                    a.create(key, np.asarray(value, dtype=np.int32).reshape(-1))
                elif isinstance(value, (list, tuple, np.ndarray)) and np.asarray(value).dtype.kind in "iu":
                    a.create(key, np.asarray(value, dtype=np.int32).reshape(-1))  # like set_attribute()
                else:
                    a.create(key, _fixed_str(value))  # a backend fact
            except (TypeError, ValueError, OverflowError) as e:
                self.abort()
                raise DumpWriteError(self.path, f"root attribute '{key}' = {value!r}: {e}") from None
            except (OSError, RuntimeError) as e:
                self._fail(e)

    def set_attribute(self, key: str, value: Any) -> None:
        """A root attribute beyond the format's: a string fact or an int32 array (e.g. the engine's argmax)."""
        if key in ROOT_ATTRIBUTES:
            raise DumpWriteError(self.path, f"attribute '{key}' is a format attribute")
        try:
            if key in self._file.attrs:
                del self._file.attrs[key]
        except (OSError, RuntimeError) as e:
            self._fail(e)
        self._write_root({key: value})

    # -- steps and checkpoints -------------------------------------------------------------------
    def step(self, step: int) -> "Writer":
        """Makes `step` the step that put() writes into (0 is the prefill): steps are 0, 1, 2, ... in order, and
        the step before must have recorded its tokens."""
        step = int(step)
        if step < 0:
            raise DumpWriteError(self.path, f"step {step} is negative")
        following = 0 if self._step is None else self._step + 1
        if step != following:
            raise DumpWriteError(self.path, f"step {step} out of order: steps are 0, 1, 2, ... and the next is "
                                 f"{following}")
        if self._step is not None and self._step not in self._tokens:
            raise DumpWriteError(self.path, f"step {self._step} recorded no tokens (put \"tokens\" first in every "
                                 "step)")
        if self._device is not None:
            # the graphs' slots are free for their next replay; the file catches up past half the staging size
            self._device.settle()
            if 2 * self._device.bytes > self._device.limit:
                self.flush()
        self._step = int(step)
        self._written.setdefault(self._step, [])
        return self

    def put(self, name: str, array: Any, layer: int | None = None, layout: str | None = None,
            native_dtype: str | None = None, *, split: str | None = None, shard_offset: int | None = None,
            partial: bool = False) -> None:
        """Records one checkpoint of the current step. Vocabulary names are checked (layer, layout, rank);
        other names (a foreign engine's) are stored as given, with layout only when passed. A torch CUDA tensor
        is copied asynchronously and written later (diffrun.cuda_staging), after the same checks.

        A tensor-parallel rank's dump (root attributes rank and world_size, docs/dump-format.md "Shards") says how
        each checkpoint is sharded: split=LETTER and shard_offset=I for this rank's slice I.. along that letter of
        the layout (column-parallel outputs: Qcur split along H, ffn_up along F), partial=True for partial sums the
        ranks' all-reduce adds up (row-parallel outputs: attn_out, ffn_out before it); neither for a replicated one."""
        if self._step is None:
            self.step(0)
        shard = self._shard_attributes(name, split, shard_offset, partial)
        if cuda_staging.is_cuda_tensor(array):
            if shard:
                raise DumpWriteError(self.path, "shard attributes are for host puts", f"step_{self._step:04d}/{name}")
            self._put_device(name, array, layer, layout, native_dtype)
        else:
            self._put(self._step, name, _as_numpy(array), layer, layout, native_dtype, shard=shard)

    def _shard_attributes(self, name: str, split: str | None, shard_offset: int | None,
                          partial: bool) -> dict[str, Any]:
        """The table columns of a shard (empty for a whole checkpoint), checked against the root attributes."""
        where = f"step_{self._step:04d}/{name}"
        if split is None and shard_offset is None and not partial:
            return {}
        if attr.world_size not in self.meta or attr.rank not in self.meta:
            raise DumpWriteError(self.path, f"shard attributes in a dump without the root attributes {attr.rank} and "
                                 f"{attr.world_size} (meta={{...}})", where)
        if split is not None and partial:
            raise DumpWriteError(self.path, "split and partial at once: a rank's piece is one or the other", where)
        if shard_offset is not None and split is None:
            raise DumpWriteError(self.path, "shard_offset without split", where)
        if partial:
            return {column.partial: 1}
        if int(shard_offset or 0) < 0:
            raise DumpWriteError(self.path, f"shard_offset {shard_offset} is negative", where)
        return {column.split: str(split), column.shard_offset: int(shard_offset or 0)}

    def _put(self, step: int, name: str, data: np.ndarray, layer: int | None, layout: str | None,
             native_dtype: str | None, write: bool = True, shard: Mapping[str, Any] | None = None) -> None:
        """put()'s checks, then (write=True) the dataset; write=False checks a device put (data: its shape and
        dtype only)."""
        if not isinstance(name, str) or not name or "/" in name or "\0" in name or name in (".", ".."):
            raise DumpWriteError(self.path, f"{name!r} is not a valid dataset name (empty, or holds '/' or NUL, or is "
                                 "'.' or '..')", f"step_{step:04d}")
        where = f"step_{step:04d}/{name}"
        pending = self._device is not None and (step, name) in self._device.names
        if name in self._written[step] or pending:
            raise DumpWriteError(self.path, "recorded twice in this step", where)
        if name == ATTRIBUTE_TABLE:
            raise DumpWriteError(self.path, "the name of the step's attribute table", where)
        if name == "tokens" and data.dtype.kind in "iu" and data.dtype != np.int32:
            if write and data.size and (int(data.min()) < 0 or int(data.max()) >= int(self._config.n_vocab)):
                bad = int(data[(data < 0) | (data >= self._config.n_vocab)].reshape(-1)[0])  # before int32 wraps it
                raise DumpWriteError(self.path, f"id {bad} outside the vocabulary 0..{self._config.n_vocab - 1}", where)
            data = data.astype(np.int32)
        native = native_dtype or _NATIVE.get(data.dtype)
        if data.dtype not in _NATIVE:
            raise DumpWriteError(self.path, f"dtype {data.dtype} is not one of float32, float16, float64, "
                                 "bfloat16 (as uint16 bits), int32", where)
        base, parsed_layer = vocabulary.parse_name(name)
        kind = vocabulary.find_kind(base)
        if layer is None:
            layer = parsed_layer
        elif kind is not None and int(layer) != parsed_layer:
            raise DumpWriteError(self.path, f"name says layer {parsed_layer} but layer={layer} was passed", where)
        if kind is not None:
            if name not in self._order:
                raise DumpWriteError(self.path, f"not a checkpoint of a {self._n_layer}-layer {self._arch} model",
                                     where)
            if layout is None:
                layout = kind.layout
            elif sorted(layout.split(",")) != sorted(kind.dims):
                raise DumpWriteError(self.path, f"layout '{layout}' is not a permutation of the vocabulary's "
                                     f"'{kind.layout}'", where)
            dims = layout.split(",")
            split = (shard or {}).get(column.split)
            if split is not None and split not in dims:
                raise DumpWriteError(self.path, f"split '{split}' is not a letter of the layout '{layout}'", where)
            if data.ndim == 2 and len(dims) == 3 and layout == kind.layout:
                # [T, H*Dh] as an engine holds it: stored [T, H, Dh] like every other writer's
                heads = int(self.meta[attr.n_head if dims[1] == dim.H else attr.n_head_kv])
                if split == dims[1]:  # this rank's heads
                    heads = data.shape[1] // int(self.meta[attr.head_dim])
                head_dim = int(self.meta[attr.head_dim])
                if data.shape[1] != heads * head_dim:
                    raise DumpWriteError(self.path, f"shape {tuple(data.shape)}: {data.shape[1]} columns are not "
                                         f"{dims[1]}*Dh = {heads}*{head_dim}", where)
                data = data.reshape(data.shape[0], heads, head_dim)
            if data.ndim != len(dims):
                raise DumpWriteError(self.path, f"shape {tuple(data.shape)} has {data.ndim} dimensions but layout "
                                     f"'{layout}' names {len(dims)}", where)
            if (name == "tokens") != (data.dtype == np.int32):
                raise DumpWriteError(self.path, "token ids are int32 and checkpoints are floats", where)
            if name == "tokens":
                self._check_tokens(step, data, int(layer), where, values=write)
            elif split is not None:
                self._check_shard(name, data, dims, split, int(shard[column.shard_offset]), step, where)
            else:
                n_tokens = self._tokens_first(step, where)
                problem = check_checkpoint(self._config, name, int(layer), tuple(int(x) for x in data.shape), layout,
                                           n_tokens, self._kv[step])
                if problem:
                    raise DumpWriteError(self.path, problem, where)
            order = self._order[name]
            if not write and dim.S in layout.split(",") and cuda_staging.capturing():
                raise DumpWriteError(self.path, "its S dimension grows every step but a graph replays fixed "
                                     "shapes: put it outside the capture", where)
        else:
            self._tokens_first(step, where)
            order = len(self._names) + len(self._written[step])
        if name == "tokens" and step not in self._tokens:
            self._tokens[step] = int(data.shape[0])
            self._kv[step] = self._kv.get(step - 1, 0) + int(data.shape[0])
        if not write:
            return
        attrs: dict[str, Any] = {}
        if data.dtype == np.int32:
            stored = data
        elif self.keep_dtype:
            stored = data
            if native == schema.BF16_MARK:
                attrs[column.dtype] = schema.BF16_MARK
        else:
            stored = bf16_to_f32(data) if data.dtype == np.uint16 else data.astype(np.float32)
        try:
            group = self._file.require_group(f"step_{step:04d}")
            group.create_dataset(name, data=np.ascontiguousarray(stored), track_times=False, fill_time="never")
        except (TypeError, ValueError) as e:
            raise DumpWriteError(self.path, f"cannot write: {e}", where) from None
        except (OSError, RuntimeError) as e:
            self._fail(e, where)
        attrs.update({column.order: int(order), column.layer: int(layer), column.native_dtype: str(native)})
        if layout is not None:
            attrs[column.layout] = layout
        attrs.update(shard or {})
        self._rows.setdefault(step, []).append((name, attrs))
        self._written[step].append(name)

    def _check_shard(self, name: str, data: np.ndarray, dims: list[str], split: str, offset: int, step: int,
                     where: str) -> None:
        """A slice along `split`: every other dimension the whole checkpoint's, the slice within it."""
        n_tokens = self._tokens_first(step, where)
        full = [self._config.size(d, n_tokens, self._kv[step]) for d in dims]
        have = list(data.shape)
        i = dims.index(split)
        if data.ndim != len(dims) or have[:i] + have[i + 1:] != full[:i] + full[i + 1:]:
            raise DumpWriteError(self.path, f"shape {tuple(have)} is not a slice along {split} of layout "
                                 f"'{','.join(dims)}' = {tuple(full)}", where)
        if offset + have[i] > full[i]:
            raise DumpWriteError(self.path, f"slice {split} {offset}..{offset + have[i] - 1} passes its size "
                                 f"{full[i]}", where)

    def _tokens_first(self, step: int, where: str) -> int:
        """The step's T; a checkpoint before the step's tokens is refused (T and S come from them)."""
        if step not in self._tokens:
            raise DumpWriteError(self.path, "put \"tokens\" first in every step (T and S come from it)", where)
        return self._tokens[step]

    def _check_tokens(self, step: int, data: np.ndarray, layer: int, where: str, values: bool) -> None:
        """The C API's checks of a step's ids: [T], inside the vocabulary, step 0's the prompt (token_ids), one
        id per decode step, the id all_token_ids feeds (teacher forcing). values=False (a device put, its data
        not there yet): the shape only; the ids are checked when they are written."""
        if layer != -1:
            raise DumpWriteError(self.path, f"layer {layer} for tokens (-1 outside layers)", where)
        if data.ndim != 1 or data.shape[0] < 1:
            raise DumpWriteError(self.path, f"shape {list(data.shape)}, expected [T] with T >= 1", where)
        if step > 0 and data.shape[0] != 1:
            raise DumpWriteError(self.path, f"{data.shape[0]} ids; a decode step feeds one", where)
        if not values:
            return
        n_vocab = self._config.n_vocab
        bad = data[(data < 0) | (data >= n_vocab)]
        if bad.size:
            raise DumpWriteError(self.path, f"id {int(bad[0])} outside the vocabulary 0..{n_vocab - 1}", where)
        ids = [int(x) for x in data]
        if step == 0:
            if ids != self._token_ids:
                raise DumpWriteError(self.path, "step 0's tokens differ from the root attribute token_ids (the "
                                     "prompt)", where)
            return
        fed = self._file.attrs.get(attr.all_token_ids) if self._file is not None else None
        i = len(self._token_ids) + step - 1
        if fed is not None and i < len(fed) and ids[0] != int(fed[i]):
            raise DumpWriteError(self.path, f"id {ids[0]} but all_token_ids feeds {int(fed[i])} at this step "
                                 "(teacher forcing)", where)

    # -- torch CUDA tensors (diffrun.cuda_staging) ---------------------------------------------------------
    def _put_device(self, name: str, tensor: Any, layer: int | None, layout: str | None,
                    native_dtype: str | None) -> None:
        dtype = cuda_staging.numpy_dtype(tensor)
        where = f"step_{self._step:04d}/{name}"
        if dtype is None and not (name == "tokens" and str(tensor.dtype) == "torch.int64"):
            raise DumpWriteError(self.path, f"dtype {tensor.dtype} is not one of float32, float16, float64, "
                                 "bfloat16, int32", where)
        t = tensor.detach()
        if name == "tokens" and str(t.dtype) == "torch.int64":
            t, dtype = t.int(), np.dtype(np.int32)
        t = t if t.is_contiguous() else t.contiguous()
        shape = tuple(int(x) for x in t.shape)
        self._put(self._step, name, np.broadcast_to(np.zeros((), dtype), shape), layer, layout, native_dtype,
                  write=False)
        if self._device is None:
            self._device = cuda_staging.Staging()
        try:
            self._device.copy(t, cuda_staging.Pending(self._step, name, shape, dtype, layer, layout, native_dtype,
                                                      None), self._write_device)
        except RuntimeError as e:
            raise DumpWriteError(self.path, str(e), where) from None

    def _write_device(self, p: cuda_staging.Pending) -> None:
        """Writes one pending device put (its copy has landed, or is waited for) after put()'s checks."""
        self._put(p.step, p.name, p.array(), p.layer, p.layout, p.native_dtype)

    def reserve_device(self, nbytes: int = 0) -> None:
        """Page-locks the staging buffer that device puts copy into: graph slots and the ring of other puts (default
        64 MiB, DIFFRUN_DUMP_STAGING_MB). Call it before capturing, not during a capture; calling it before the first
        device put also keeps that put from page-locking it (milliseconds; it may synchronize)."""
        if self._device is None:
            self._device = cuda_staging.Staging()
        try:
            self._device.reserve(nbytes or cuda_staging.default_bytes())
        except RuntimeError as e:
            raise DumpWriteError(self.path, str(e)) from None

    def capture_end(self) -> int:
        """After the capture, before the graph's first replay: the CUDA tensors put while capturing since the last
        call form one graph; its id. Pending puts in the staging ring where the new graph slots lie are written
        first (waiting for their copies)."""
        if self._device is None:
            self._device = cuda_staging.Staging()
        return self._device.capture_end(self._write_device)

    def replay(self, graph: int) -> None:
        """After each replay of the graph (on the current stream): its copies are the current step's checkpoints,
        checked against the step first."""
        if self._device is None or not 0 <= graph < len(self._device.graphs):
            raise DumpWriteError(self.path, f"graph {graph} is not a graph capture_end() returned")
        if self._step is None:
            self.step(0)
        slots = self._device.graphs[graph]
        names = [p.name for p in slots]
        for p in slots:
            self._put(self._step, p.name, np.broadcast_to(np.zeros((), p.dtype), p.shape), p.layer, p.layout,
                      p.native_dtype, write=False)
        if len(set(names)) != len(names):
            raise DumpWriteError(self.path, f"graph {graph} records a name twice")
        self._device.launched(graph, self._step, slots)

    def flush(self) -> None:
        """Waits for every pending CUDA copy and writes it (close() does too)."""
        if self._device is None:
            return
        self._device.flush(self._write_device)

    @property
    def current_step(self) -> int | None:
        """The step put() writes into (None before the first step() or put())."""
        return self._step

    def names(self, step: int) -> list[str]:
        """The names put() wrote into `step` so far, in call order."""
        return list(self._written.get(step, []))

    # -- finishing -------------------------------------------------------------------------------
    def close(self) -> None:
        """Closes the file and renames it into place; a dump that breaks the format's contract (no step 0 with
        its tokens, a step without tokens, root attributes that do not hold) is removed instead: DumpWriteError."""
        if self._file is None:
            return
        try:
            if self._device is not None:
                self.flush()  # device puts are checked again as they are written (tokens: their ids)
                self._device.release()
            problem = self._contract_problem()
        except BaseException:
            self.abort()
            raise
        if problem:
            self.abort()
            raise DumpWriteError(self.path, f"{problem}; not renamed into place, the temporary '{self._tmp}' was "
                                 "removed")
        try:
            for step, rows in self._rows.items():
                self._file[f"step_{step:04d}"].create_dataset(ATTRIBUTE_TABLE, data=_table(rows), track_times=False)
            self._rows = {}
            if attr.all_token_ids not in self._file.attrs:
                # every token fed, step by step (docs/dump-format.md): what a replay of this dump needs
                ids = [self._file[f"step_{s:04d}/tokens"][()] for s in sorted(self._written)
                       if "tokens" in self._written[s]]
                if ids:
                    self._file.attrs.create(attr.all_token_ids, np.concatenate(ids).astype(np.int32))
            problem = self._final_root_problem()
            if problem:
                self.abort()
                raise DumpWriteError(self.path, f"{problem}; not renamed into place, the temporary '{self._tmp}' "
                                     "was removed")
            self._file.flush()
            self._file.close()
        except (OSError, RuntimeError) as e:
            self._fail(e)
        self._file = None
        # The name still holds the file written, and the target is still no device, FIFO or directory.
        try:
            st = os.lstat(self._tmp)
            same = stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == self._tmp_id
        except OSError:
            same = False
        if not same:
            _unguard(id(self))
            raise DumpWriteError(self.path, f"the temporary '{self._tmp}' was replaced or removed while the dump "
                                 "was written; not renamed")
        aside = None
        try:
            self._check_target()
            # An old dump moved aside first: a rename over an existing file makes ext4 write the new one out before
            # it returns (57-91 ms per 124 MB measured); the path is absent only between the two renames, and a
            # failed second one puts the old dump back.
            try:
                if stat.S_ISREG(os.lstat(self.path).st_mode):
                    aside = f"{self.path}.replaced{TEMP_INFIX}{os.getpid()}"
                    os.rename(self.path, aside)
            except FileNotFoundError:
                aside = None
            try:
                os.rename(self._tmp, self.path) if aside else os.replace(self._tmp, self.path)
            except OSError:
                if aside:
                    os.rename(aside, self.path)
                    aside = None
                raise
            if aside:
                os.unlink(aside)
        except (DumpWriteError, OSError) as e:
            try:
                os.unlink(self._tmp)
            except OSError:
                pass
            _unguard(id(self))
            if isinstance(e, DumpWriteError):
                raise
            raise DumpWriteError(self.path, f"cannot rename '{self._tmp}' to it: {_reason(e)}") from None
        _unguard(id(self))

    def _contract_problem(self) -> str | None:
        """What the steps recorded lack for a valid dump (the C API's close: at least step 0 with its tokens;
        every step recorded holds tokens, numbered 0.. without gaps); None when nothing."""
        if 0 not in self._tokens:
            return "no step recorded (a dump holds at least step 0 with its tokens)"
        recorded = sorted(s for s, names in self._written.items() if names)
        for s in range(recorded[-1] + 1):
            if s not in self._tokens:
                return f"step {s} recorded no tokens (steps are numbered from 0 without gaps, each with its tokens)"
        return None

    def _final_root_problem(self) -> str | None:
        """The root attributes as the file holds them at close (set_attribute may have added all_token_ids or
        argmax), against the steps written."""
        root = _check_root(self._file)
        if root.problems:
            return self._root_text(root)
        last = max(s for s, names in self._written.items() if names)
        if root.all_token_ids is not None and len(root.all_token_ids) < len(root.token_ids) + last:
            return (f"root attribute 'all_token_ids': holds {len(root.all_token_ids)} ids; {last} decode steps after "
                    f"a prompt of {len(root.token_ids)} need at least {len(root.token_ids) + last}")
        if root.argmax is not None and len(root.argmax) != last + 1:
            return f"root attribute 'argmax': holds {len(root.argmax)} ids for {last + 1} steps (one per step)"
        return None

    def abort(self) -> None:
        """Closes and removes the temporary file; nothing appears at the path. Never raises."""
        if getattr(self, "_device", None) is not None:
            self._device.release()  # copies in flight land before the buffer is unlocked
            self._device = None
        f, self._file = getattr(self, "_file", None), None
        if f is not None:
            try:
                # Emptied first: HDF5's close writes its metadata, which on a full disk would fail again
                # (and leave the file half-closed in the library, which crashes at exit).
                os.ftruncate(f.id.get_vfd_handle(), 0)
            except (OSError, RuntimeError, ValueError):
                pass
            try:
                f.close()
            except (OSError, RuntimeError, ValueError):
                pass
            try:
                os.unlink(self._tmp)
            except OSError:
                pass
        _unguard(id(self))

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        if getattr(self, "_file", None) is not None:
            self.abort()


def _as_numpy(array: Any) -> np.ndarray:
    """numpy arrays as they are; torch tensors (bf16 included, as uint16 bits) detached to the CPU."""
    if isinstance(array, np.ndarray):
        return array
    if hasattr(array, "detach") and hasattr(array, "dtype"):
        t = array.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            import torch

            return t.contiguous().view(torch.int16).numpy().view(np.uint16)
        return t.numpy()
    return np.asarray(array)


def open(path: str | os.PathLike[str], **kwargs: Any) -> Writer:  # noqa: A001 - mirrors diffrun.open
    """Opens a dump for writing: open(path, backend=..., precision=..., like=REF or meta={...})."""
    return Writer(path, **kwargs)
