#!/usr/bin/env python3
"""Small seed corpora for the libFuzzer targets in fuzz/ (each seed a few kB, none over 64 kB).

Usage: fuzz/seeds.py gguf|tolerances|dump OUT_DIR [BASE_DUMP]
  gguf        tiny GGUF files made with the gguf package's GGUFWriter: every metadata type, the
              dequantizable tensor types, a runnable one-layer qwen2
  tolerances  the presets in fixtures/tolerances and small hand-written rule files
  dump        BASE_DUMP (a small dump written by `diffrun dump`, format version 2) and variants of it
              made with h5py in the forms readers accept: float16, bfloat16 as uint16, no attribute
              table, per-head tensors 2-D or permuted, llama.cpp names, row_offset, gzip chunks, an
              integer dataset; and the base in the version-1 form (refused without DIFFRUN_READ_V1=1)
"""
import os
import shutil
import sys

import numpy as np


def gguf_seeds(out):
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf.constants import GGML_QUANT_SIZES

    rng = np.random.default_rng(7)

    def write(name, arch, tensors, alignment=None, extra=True):
        w = gguf.GGUFWriter(f"{out}/{name}.gguf", arch)
        if alignment:
            w.add_custom_alignment(alignment)
        if extra:
            w.add_uint8("t.u8", 200); w.add_int8("t.i8", -5); w.add_uint16("t.u16", 60000)
            w.add_int16("t.i16", -300); w.add_int32("t.i32", -70000); w.add_uint64("t.u64", 2**63 + 5)
            w.add_int64("t.i64", -2**40); w.add_float32("t.f32", -0.0); w.add_float64("t.f64", 1e-310)
            w.add_bool("t.bool", True); w.add_string("t.str", "h\u00e9llo")
            w.add_array("t.arr", [1, 2, 3]); w.add_array("t.strs", ["a", "bc", ""])
            w.add_array("t.nested", [[1, 2], [3]])
        w.add_block_count(1); w.add_embedding_length(256); w.add_feed_forward_length(256)
        w.add_head_count(4); w.add_head_count_kv(2); w.add_context_length(64)
        w.add_layer_norm_rms_eps(1e-5); w.add_rope_freq_base(10000.0)
        w.add_token_list([f"t{i}" for i in range(8)])
        for tname, qtype, rows in tensors:
            elems, nbytes = GGML_QUANT_SIZES[qtype]
            if qtype == T.F32:
                w.add_tensor(tname, rng.standard_normal((rows, 256)).astype(np.float32))
            elif qtype == T.F16:
                w.add_tensor(tname, rng.standard_normal((rows, 256)).astype(np.float16))
            else:
                raw = rng.integers(0, 256, size=(rows, 256 // elems * nbytes), dtype=np.uint8)
                w.add_tensor(tname, raw, raw_dtype=qtype)
        w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

    types = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS]
    write("all-types", "llama", [(f"w.{t.name}", t, 2) for t in types])
    write("aligned-64", "qwen2", [("a", T.Q8_0, 1), ("b", T.F32, 1)], alignment=64)
    write("minimal", "qwen3", [("x", T.F16, 1)], extra=False)

    # A whole runnable one-layer qwen2 (D 32, H 4, Hkv 2, F 64, V 8), so config and validation pass too.
    w = gguf.GGUFWriter(f"{out}/runnable-qwen2.gguf", "qwen2")
    w.add_block_count(1); w.add_embedding_length(32); w.add_feed_forward_length(64)
    w.add_head_count(4); w.add_head_count_kv(2); w.add_context_length(64)
    w.add_layer_norm_rms_eps(1e-6); w.add_token_list([f"t{i}" for i in range(8)])
    shapes = {"token_embd.weight": (8, 32), "output_norm.weight": (32,), "blk.0.attn_norm.weight": (32,),
              "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (16, 32), "blk.0.attn_v.weight": (16, 32),
              "blk.0.attn_q.bias": (32,), "blk.0.attn_k.bias": (16,), "blk.0.attn_v.bias": (16,),
              "blk.0.attn_output.weight": (32, 32), "blk.0.ffn_norm.weight": (32,),
              "blk.0.ffn_gate.weight": (64, 32), "blk.0.ffn_up.weight": (64, 32), "blk.0.ffn_down.weight": (32, 64)}
    for tname, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 2 and shape[-1] % 32 == 0:
            w.add_tensor(tname, gguf.quants.quantize(x, T.Q8_0), raw_dtype=T.Q8_0)
        else:
            w.add_tensor(tname, x)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def tolerance_seeds(out):
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "tolerances")
    for name in sorted(os.listdir(root)):
        if name.endswith(".json"):
            shutil.copy(os.path.join(root, name), os.path.join(out, name))
    small = {
        "minimal.json": '{"rules": [], "default": {"max_rel_l2": 1e-5, "reason": "r"}}',
        "rules.json": '{"preset": "x", "description": "d", "rules": [{"match": "Qcur-*", "max_abs": 1e-3, '
                      '"max_row_rel_l2": 1e-4, "atol": 1e-6, "rtol": 1e-5, "reason": "q"}, {"match": "result_output", '
                      '"min_cosine": 0.999, "max_fail_frac": 0.01, "reason": "logits"}], '
                      '"default": {"max_nmse": 1e-8, "max_head_rel_l2": 1e-4, "reason": "default"}}',
        "escapes.json": '{"rules": [{"match": "kq_soft_max-?", "max_abs": 1e-2, "reason": "a \\"q\\" \\u00e9"}], '
                        '"default": {"max_abs": 1, "reason": "r"}}',
    }
    for name, text in small.items():
        with open(os.path.join(out, name), "w") as f:
            f.write(text)


def dump_seeds(out, base):
    import h5py

    if not base or not os.path.exists(base):
        print(f"fuzz/seeds.py: no base dump ({base}); dump seeds need one", file=sys.stderr)
        return
    shutil.copy(base, os.path.join(out, "base.h5"))

    def variant(name, change):
        path = os.path.join(out, name + ".h5")
        shutil.copy(base, path)
        with h5py.File(path, "r+") as f:
            change(f)

    def replace(g, name, data, **kw):
        del g[name]
        return g.create_dataset(name, data=data, **kw)

    def edit_table(g, change):
        """Rewrites the step's attribute table (_attributes) after change(rows), rows a list of dicts;
        string columns are resized to their longest value."""
        t = g["_attributes"][()]
        rows = [{k: row[k] for k in t.dtype.names} for row in t]
        change(rows)
        cols = []
        for k in t.dtype.names:
            if t.dtype[k].kind == "S":
                cols.append((k, f"S{max([1] + [len(r[k]) for r in rows])}"))
            else:
                cols.append((k, t.dtype[k]))
        new = np.array([tuple(r[k] for k in t.dtype.names) for r in rows], dtype=cols)
        del g["_attributes"]
        g.create_dataset("_attributes", data=new)

    def set_attr(g, name, key, value):
        def change(rows):
            for r in rows:
                if r["name"] == name.encode():
                    r[key] = value.encode() if isinstance(value, str) else value
        edit_table(g, change)

    def f16(f):
        g = f["step_0000"]
        replace(g, "embd", g["embd"][()].astype(np.float16))

    def bf16(f):
        g = f["step_0000"]
        bits = (g["embd"][()].astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        replace(g, "embd", bits)
        set_attr(g, "embd", "dtype", "bf16")

    def bare(f):
        for s in f.values():
            del s["_attributes"]

    def merged(f):
        g = f["step_0000"]
        q = g["Qcur-0"][()]
        replace(g, "Qcur-0", q.reshape(q.shape[0], -1))

    def permuted(f):
        g = f["step_0000"]
        replace(g, "Qcur-0", np.ascontiguousarray(g["Qcur-0"][()].transpose(1, 0, 2)))
        set_attr(g, "Qcur-0", "layout", "H,T,Dh")

    def llamacpp(f):
        for s in f.values():
            for old, new in (("embd", "inp_embd"), ("Qcur-0", "Qcur-0#2")):
                if old in s:
                    s.move(old, new)
                    set_attr(s, old, "name", new)

    def row_offset(f):
        g = f["step_0000"]
        p = g["kq_soft_max-0"][()]
        replace(g, "kq_soft_max-0", p[:, 1:, :])
        set_attr(g, "kq_soft_max-0", "row_offset", 1)

    def gzip(f):
        g = f["step_0001"]
        replace(g, "l_out-1", g["l_out-1"][()], compression="gzip", chunks=True)

    def extra_int(f):
        f["step_0000"].create_dataset("inp_pos", data=np.arange(2, dtype=np.int32))

    for name, change in [("f16", f16), ("bf16", bf16), ("bare", bare), ("merged", merged), ("permuted", permuted),
                         ("llamacpp", llamacpp), ("row_offset", row_offset), ("gzip", gzip), ("extra_int", extra_int)]:
        variant(name, change)

    # The version-1 form (variable-length strings): read only with DIFFRUN_READ_V1=1, so a reader
    # must refuse it, and its mutations, before reading a string.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import dump_h5

    v1 = os.path.join(out, "version1.h5")
    shutil.copy(base, v1)
    dump_h5.to_version_1(v1)


def main():
    if len(sys.argv) < 3 or sys.argv[1] not in ("gguf", "tolerances", "dump"):
        print(__doc__, file=sys.stderr)
        return 2
    out = sys.argv[2]
    os.makedirs(out, exist_ok=True)
    if sys.argv[1] == "gguf":
        gguf_seeds(out)
    elif sys.argv[1] == "tolerances":
        tolerance_seeds(out)
    else:
        dump_seeds(out, sys.argv[3] if len(sys.argv) > 3 else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
