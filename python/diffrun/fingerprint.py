"""A GGUF file's fingerprint, the same value as model/gguf.cpp's GgufFile::fingerprint() (dumps' model_fingerprint).

"<file size>:<FNV-1a 64 of the bytes before the tensor data, 16 hex digits>": the header, the metadata and
the tensor table, i.e. everything but the weights, so it is cheap and changes with any re-quantization.
The data offset is found by walking the GGUF header (versions 2 and 3) with no dependency beyond Python.
"""

from __future__ import annotations

import mmap
import os
import struct

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> size in bytes of the fixed-width ones.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class GgufError(Exception):
    """Not a GGUF file, or a header that runs past the end of the file; the message names the file and offset."""


class _Cursor:
    def __init__(self, path: str, data: bytes):
        self.path, self.data, self.pos = path, data, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise GgufError(f"{self.path}: {what} at offset {self.pos} runs past the end of the file "
                            f"({len(self.data)} bytes)")
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def string(self, what: str) -> bytes:
        return self.take(self.u64(what + " length"), what)

    def skip_value(self, vtype: int, what: str) -> None:
        if vtype in _FIXED:
            self.take(_FIXED[vtype], what)
        elif vtype == _STRING:
            self.string(what)
        elif vtype == _ARRAY:
            etype = self.u32(what + " element type")
            n = self.u64(what + " element count")
            if etype in _FIXED:
                self.take(_FIXED[etype] * n, what)
            else:
                for i in range(n):
                    self.skip_value(etype, f"{what}[{i}]")
        else:
            raise GgufError(f"{self.path}: {what}: unknown value type {vtype} at offset {self.pos}")


def data_offset(path: str | os.PathLike[str]) -> int:
    """Byte offset of the tensor data: the end of the tensor table rounded up to general.alignment."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise GgufError(f"{path}: empty file, not a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:  # only the header's pages are read
            return _data_offset(path, m)


def _data_offset(path: str, head) -> int:
    c = _Cursor(path, head)
    if c.take(4, "magic") != GGUF_MAGIC:
        raise GgufError(f"{path}: not a GGUF file (no GGUF magic at offset 0)")
    version = c.u32("version")
    if version not in (2, 3):
        raise GgufError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors = c.u64("tensor count")
    n_kv = c.u64("metadata count")
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = c.string(f"metadata key {i}")
        vtype = c.u32(f"type of '{key.decode(errors='replace')}'")
        if key == b"general.alignment" and vtype == 4:
            alignment = struct.unpack("<I", c.take(4, "general.alignment"))[0]
        else:
            c.skip_value(vtype, f"value of '{key.decode(errors='replace')}'")
    for i in range(n_tensors):
        c.string(f"name of tensor {i}")
        n_dims = c.u32(f"dimension count of tensor {i}")
        c.take(8 * n_dims + 4 + 8, f"table entry of tensor {i}")
    if alignment == 0:
        raise GgufError(f"{path}: general.alignment is 0")
    return (c.pos + alignment - 1) // alignment * alignment


def fingerprint(path: str | os.PathLike[str]) -> str:
    """The model_fingerprint diffrun writes into dumps of this GGUF."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    end = min(data_offset(path), size)
    with open(path, "rb") as f:
        header = f.read(end)
    h = 0xCBF29CE484222325  # FNV-1a 64 offset basis
    prime, mask = 0x100000001B3, 0xFFFFFFFFFFFFFFFF
    for byte in header:
        h = ((h ^ byte) * prime) & mask
    return f"{size}:{h:016x}"
