#!/usr/bin/env python3
"""Dumps what the gguf package's GGUFReader sees in a GGUF file, for tests/test_gguf.cpp to compare against.

Usage: gguf_to_json.py [--rows N] OUT_DIR MODEL.gguf [MODEL.gguf ...]

For each MODEL, OUT_DIR/<stem>.json: version, alignment, data_offset, every metadata key in file order with its value type
(element type for arrays) and values, and every tensor's name, ggml type, dims (ne order),
absolute data offset, element and byte counts; and the package's block sizes per ggml type. Strings are hex-encoded bytes (token lists hold
arbitrary bytes). Arrays are given as their flattened leaf values, which is how GGUFReader
exposes nested arrays. OUT_DIR/<stem>.f32: the first N rows (ne[1..] flattened, default 8) of
every tensor, dequantized by gguf.quants.dequantize, back to back as little-endian float32; the
JSON gives each tensor's element offset and count in that file.
"""
import argparse
import json
from pathlib import Path

import numpy as np
import gguf
from gguf import GGUFReader, GGUFValueType


def leaf(field, part_index, leaf_type):
    part = field.parts[part_index]
    if leaf_type == GGUFValueType.STRING:
        return bytes(part.tobytes()).hex()
    value = part.tolist()[0]
    if leaf_type == GGUFValueType.BOOL:
        return bool(value)
    return value


def field_json(field):
    types = list(field.types)
    main = types[0]
    entry = {"key": field.name, "type": main.name}
    if main == GGUFValueType.ARRAY:
        entry["elem_type"] = types[1].name
        entry["values"] = [leaf(field, i, types[-1]) for i in field.data]
    else:
        entry["value"] = leaf(field, field.data[0], main)
    return entry


def dump(model, out_dir, rows):
    reader = GGUFReader(model)
    doc = {"alignment": int(reader.alignment), "data_offset": int(reader.data_offset), "metadata": [],
           "tensors": [],
           "quant_sizes": {t.name: list(v) for t, v in gguf.constants.GGML_QUANT_SIZES.items()}}
    for name, field in reader.fields.items():
        if name == "GGUF.version":
            doc["version"] = int(field.parts[-1][0])
        elif name.startswith("GGUF."):
            continue  # tensor and kv counts: implied by the lists
        else:
            doc["metadata"].append(field_json(field))

    stem = Path(out_dir) / Path(model).stem
    offset = 0
    with open(f"{stem}.f32", "wb") as f32:
        for t in reader.tensors:
            # reader.tensors' data has the rows on its leading axes; keep the first `rows` rows.
            head = t.data.reshape(-1, t.data.shape[-1])[:rows]
            deq = gguf.quants.dequantize(head, t.tensor_type).astype("<f4").reshape(-1)
            f32.write(deq.tobytes())
            doc["tensors"].append({"name": t.name, "type": int(t.tensor_type), "ne": [int(x) for x in t.shape],
                                   "data_offset": int(t.data_offset), "n_elements": int(t.n_elements),
                                   "n_bytes": int(t.n_bytes), "f32_offset": offset, "f32_count": int(deq.size)})
            offset += deq.size
    with open(f"{stem}.json", "w") as f:
        json.dump(doc, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("out_dir")
    ap.add_argument("models", nargs="+")
    args = ap.parse_args()
    for model in args.models:
        dump(model, args.out_dir, args.rows)


if __name__ == "__main__":
    main()
