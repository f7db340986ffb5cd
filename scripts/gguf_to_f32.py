#!/usr/bin/env python3
"""Writes an F32 copy of a GGUF model: every tensor dequantized with the gguf package, every metadata record kept.

    scripts/gguf_to_f32.py IN.gguf OUT.gguf

Each tensor is dequantized to float32 by gguf.quants.dequantize (the gguf package's own code, not
diffrun's) and stored as F32 with the same name and dims, so two engines given the copy compute
with identical weights. Every metadata key/value is copied byte for byte (type and encoding
included), except general.file_type, which becomes 0 (ALL_F32) since that is what the file now
holds. The GGUF version and alignment are kept; the output is written atomically.
Exit codes: 0 written, 2 bad input (not a GGUF, unknown tensor type, unwritable output).
"""
from __future__ import annotations

import argparse
import os
import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

FILE_TYPE_KEY = "general.file_type"
FILE_TYPE_ALL_F32 = 0


def field_bytes(reader: GGUFReader, field) -> bytes:
    """The exact bytes of one key/value record as stored in the file."""
    size = sum(int(p.nbytes) for p in field.parts)
    return bytes(reader.data[field.offset:field.offset + size])


def set_file_type(raw: bytes, field) -> bytes:
    """The general.file_type record with its value (the last part, of its own integer type) set to ALL_F32."""
    value = field.parts[-1]
    if field.types[0] not in (GGUFValueType.UINT32, GGUFValueType.INT32):
        raise ValueError(f"{FILE_TYPE_KEY} has non-integer type {field.types[0].name}")
    new = value.copy()
    new[0] = FILE_TYPE_ALL_F32
    return raw[:len(raw) - value.nbytes] + new.tobytes()


def to_f32(src: Path, dst: Path) -> tuple[int, int]:
    """Writes the F32 copy; returns (tensors written, tensors that were not F32 before)."""
    reader = GGUFReader(str(src))
    align_field = reader.fields.get("general.alignment")
    alignment = align_field.contents() if align_field is not None else 32
    version = reader.fields["GGUF.version"].contents()

    kv = []
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        raw = field_bytes(reader, field)
        kv.append(set_file_type(raw, field) if name == FILE_TYPE_KEY else raw)

    infos, offsets, offset, converted = [], [], 0, 0
    for t in reader.tensors:
        offset = (offset + alignment - 1) // alignment * alignment
        offsets.append(offset)
        name = t.name.encode()
        dims = [int(d) for d in t.shape]  # ne order, as stored
        infos.append(struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims))
                     + struct.pack(f"<{len(dims)}Q", *dims)
                     + struct.pack("<IQ", int(GGMLQuantizationType.F32), offset))
        offset += int(t.n_elements) * 4
        converted += t.tensor_type != GGMLQuantizationType.F32

    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(b"GGUF" + struct.pack("<IQQ", version, len(reader.tensors), len(kv)))
            for raw in kv:
                f.write(raw)
            for info in infos:
                f.write(info)
            f.write(b"\0" * (-f.tell() % alignment))
            data_start = f.tell()
            for t, off in zip(reader.tensors, offsets):
                try:
                    values = dequantize(t.data, t.tensor_type)
                except NotImplementedError as e:
                    raise ValueError(f"{src}: tensor '{t.name}': cannot dequantize type "
                                     f"{GGMLQuantizationType(t.tensor_type).name}: {e}") from e
                values = np.ascontiguousarray(values, dtype="<f4").reshape(-1)
                if values.size != int(t.n_elements):
                    raise ValueError(f"{src}: tensor '{t.name}': dequantized to {values.size} values, "
                                     f"expected {int(t.n_elements)}")
                f.write(b"\0" * (data_start + off - f.tell()))
                f.write(values.tobytes())
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return len(reader.tensors), converted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="input GGUF")
    ap.add_argument("dst", type=Path, help="output GGUF (F32)")
    args = ap.parse_args()
    try:
        n, converted = to_f32(args.src, args.dst)
    except (OSError, ValueError, KeyError) as e:
        msg = str(e) if str(args.src) in str(e) else f"{args.src}: {e}"
        print(f"gguf_to_f32: {msg}", file=sys.stderr)
        return 2
    print(f"gguf_to_f32: wrote {args.dst} ({args.dst.stat().st_size / 2**20:.1f} MiB): "
          f"{n} tensors as F32, {converted} of them dequantized")
    return 0


if __name__ == "__main__":
    sys.exit(main())
