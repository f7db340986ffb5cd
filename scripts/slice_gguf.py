#!/usr/bin/env python3
"""Writes a copy of a GGUF model that keeps only its first N layers: real trained weights in a small file.

    scripts/slice_gguf.py IN.gguf OUT.gguf --layers N

Keeps blk.0 .. blk.N-1 and every non-layer tensor (token embedding, output norm, output head),
sets <arch>.block_count = N, and copies everything else byte for byte: every other metadata
key/value (type and encoding included), the GGUF version, the alignment, each tensor's type, dims
and data. Only the tensor count, the tensor offsets and the padding between tensors change.
Needs only numpy and the gguf package (for reading); the output is written atomically.
"""
from __future__ import annotations

import argparse
import os
import re
import struct
import sys
from pathlib import Path

from gguf import GGUFReader, GGUFValueType

LAYER_RE = re.compile(r"^blk\.(\d+)\.")


def field_bytes(reader: GGUFReader, field) -> bytes:
    """The exact bytes of one key/value record as stored in the file."""
    size = sum(int(p.nbytes) for p in field.parts)
    return bytes(reader.data[field.offset:field.offset + size])


def set_block_count(raw: bytes, field, n_layers: int) -> bytes:
    """The block_count record with its value (the last part, of the field's own integer type) replaced."""
    value = field.parts[-1]
    if field.types[0] not in (GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64):
        raise ValueError(f"{field.name} has non-integer type {field.types[0].name}")
    new = value.copy()
    new[0] = n_layers
    return raw[:len(raw) - value.nbytes] + new.tobytes()


def slice_gguf(src: Path, dst: Path, n_layers: int) -> tuple[int, int]:
    """Writes the slice; returns (tensors kept, tensors dropped)."""
    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    key = f"{arch}.block_count"
    if key not in reader.fields:
        raise ValueError(f"{src}: no {key} in the metadata")
    total = reader.fields[key].contents()
    if not 1 <= n_layers <= total:
        raise ValueError(f"{src}: --layers must be in 1..{total}, got {n_layers}")
    align_field = reader.fields.get("general.alignment")
    alignment = align_field.contents() if align_field is not None else 32
    version = reader.fields["GGUF.version"].contents()

    kv = []
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        raw = field_bytes(reader, field)
        kv.append(set_block_count(raw, field, n_layers) if name == key else raw)

    kept = [t for t in reader.tensors
            if not ((m := LAYER_RE.match(t.name)) and int(m.group(1)) >= n_layers)]
    infos, offsets, offset = [], [], 0
    for t in kept:
        offset = (offset + alignment - 1) // alignment * alignment
        offsets.append(offset)
        name = t.name.encode()
        dims = [int(d) for d in t.shape]
        infos.append(struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims))
                     + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", int(t.tensor_type), offset))
        offset += int(t.n_bytes)

    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(b"GGUF" + struct.pack("<IQQ", version, len(kept), len(kv)))
            for raw in kv:
                f.write(raw)
            for info in infos:
                f.write(info)
            f.write(b"\0" * (-f.tell() % alignment))
            data_start = f.tell()
            for t, off in zip(kept, offsets):
                f.write(b"\0" * (data_start + off - f.tell()))
                f.write(reader.data[t.data_offset:t.data_offset + int(t.n_bytes)].tobytes())
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return len(kept), len(reader.tensors) - len(kept)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="input GGUF")
    ap.add_argument("dst", type=Path, help="output GGUF")
    ap.add_argument("--layers", type=int, required=True, help="number of leading layers to keep")
    args = ap.parse_args()
    try:
        kept, dropped = slice_gguf(args.src, args.dst, args.layers)
    except (OSError, ValueError) as e:
        print(f"slice_gguf: {e}", file=sys.stderr)
        return 1
    print(f"slice_gguf: wrote {args.dst} ({args.dst.stat().st_size / 2**20:.1f} MiB): {args.layers} layers, "
          f"{kept} tensors kept, {dropped} dropped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
