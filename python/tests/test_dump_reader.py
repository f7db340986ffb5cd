"""Dumps written by the C++ writer open in plain h5py with the documented layout and in diffrun.

Needs DIFFRUN_DUMP_SAMPLE (the tests/dump_sample program; ctest sets it) and the package importable (scripts/setup installs it; ctest sets PYTHONPATH=python).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import diffrun
from diffrun import vocabulary

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import dump_h5  # noqa: E402  (plain-h5py table access, the version-1 form)

SAMPLE = os.environ.get("DIFFRUN_DUMP_SAMPLE", "")

ROOT_ATTRS = {
    "format": bytes, "format_version": np.integer, "backend": bytes, "precision": bytes, "model_path": bytes,
    "model_fingerprint": bytes, "arch": bytes, "n_layer": np.integer, "n_embd": np.integer, "n_head": np.integer,
    "n_head_kv": np.integer, "head_dim": np.integer, "n_ff": np.integer, "n_vocab": np.integer,
    "n_ctx": np.integer, "rope_theta": np.floating, "rope_type": bytes, "rms_eps": np.floating,
    "tied_output": np.bool_, "qkv_bias": np.bool_, "qk_norm": np.bool_, "prompt": bytes, "token_ids": np.ndarray,
    "created_utc": bytes, "diffrun_version": bytes,
}


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    if not SAMPLE or not os.path.exists(SAMPLE):
        pytest.fail("DIFFRUN_DUMP_SAMPLE must name the built tests/dump_sample program (run through ctest)")
    path = tmp_path_factory.mktemp("dumps") / "sample.h5"
    subprocess.run([SAMPLE, str(path)], check=True)
    return path


def expected_values(step, order, n):
    return (np.float32(step * 1000 + order) + np.arange(n, dtype=np.float32) / np.float32(1024)).astype(np.float32)


def test_plain_h5py_sees_the_documented_layout(sample):
    with h5py.File(sample, "r") as f:
        for key, kind in ROOT_ATTRS.items():
            assert key in f.attrs, key
            assert isinstance(f.attrs[key], kind), (key, type(f.attrs[key]))
            if kind is bytes:  # fixed-length UTF-8, sized to the value
                t = f.attrs.get_id(key).get_type()
                assert not t.is_variable_str() and t.get_cset() == h5py.h5t.CSET_UTF8, key
                assert t.get_size() == max(1, len(f.attrs[key])), key
        assert f.attrs["format"] == b"diffrun-dump"
        assert f.attrs["format_version"] == 2
        assert f.attrs["arch"] == b"qwen3"
        assert f.attrs["prompt"].decode("utf-8") == "Café ✓"
        assert f.attrs["token_ids"].dtype == np.int32
        assert list(f.attrs["token_ids"]) == [2, 3, 5, 7, 11]
        assert bool(f.attrs["qk_norm"]) and bool(f.attrs["tied_output"]) and not bool(f.attrs["qkv_bias"])
        assert f.attrs["device"] == b"sample" and f.attrs["tf32"] == b"off"
        assert list(f.attrs["argmax"]) == [7, 13]
        assert __import__("re").fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", f.attrs["created_utc"].decode())
        assert sorted(f.keys()) == ["step_0000", "step_0001"]

        names = vocabulary.checkpoint_names("qwen3", int(f.attrs["n_layer"]))
        for step, (T, S) in enumerate([(5, 5), (1, 6)]):
            group = f[f"step_{step:04d}"]
            assert sorted(group.keys()) == sorted(names + ["_attributes"])
            # the attribute table: a numpy structured array, one row per dataset, in the order written
            t = group["_attributes"][()]
            assert t.dtype.names == ("name", "order", "layer", "layout", "native_dtype", "row_offset", "dtype", "split",
                                     "shard_offset", "partial")
            assert [n.decode() for n in t["name"]] == names and list(t["order"]) == list(range(len(names)))
            assert t.dtype["name"].itemsize == max(len(n) for n in names)
            table = dump_h5.table(group)
            sizes = vocabulary.dim_sizes(f.attrs, T, S)
            for order, name in enumerate(names):
                ds = group[name]
                a = table[name]
                assert len(ds.attrs) == 0, name  # version 2: no attributes on the datasets
                base, layer = vocabulary.parse_name(name)
                kind = vocabulary.find_kind(base)
                assert a["order"] == order
                assert a["layer"] == layer
                assert a["layout"] == kind.layout
                assert isinstance(a["native_dtype"], str)
                want = tuple(sizes[d] for d in kind.dims)
                cut = kind.dims[0] == "S" and S > T  # the cache rows the step wrote (docs/dump-format.md, Rows)
                if cut:
                    assert a["row_offset"] == S - T, name
                    want = (T,) + want[1:]
                else:
                    assert "row_offset" not in a, name
                assert ds.shape == want, name
                assert ds.chunks is None and ds.compression is None
                if name == "tokens":
                    assert ds.dtype == np.dtype("<i4") and a["native_dtype"] == "i32"
                    assert list(ds[()]) == [2, 3, 5, 7, 11, 13][S - T:S]
                else:
                    assert ds.dtype == np.dtype("<f4")
                    assert a["native_dtype"] == ("f16" if base == "Qnorm" else "f32")
                    full = expected_values(step, order, int(np.prod([sizes[d] for d in kind.dims])))
                    np.testing.assert_array_equal(ds[()].ravel(), full[full.size - ds.size:])


def test_package_reads_the_dump(sample):
    with diffrun.open(sample) as d:
        assert d.meta["backend"] == "cpu" and d.meta["n_layer"] == 2 and d.meta["qk_norm"] is True
        assert d.meta["rope_theta"] == 1000000.0 and d.meta["device"] == "sample"
        assert d.steps() == [0, 1]
        assert d.names(step=1) == vocabulary.checkpoint_names("qwen3", 2)
        q = d.get("Qnorm-1", step=0)
        assert q.shape == (5, 4, 2) and q.dtype == np.float32
        info = d.info("Qnorm-1", step=0)
        assert (info.order, info.layer, info.layout, info.native_dtype, info.shape) == (26, 1, "T,H,Dh", "f16", (5, 4, 2))
        np.testing.assert_array_equal(q.ravel(), expected_values(0, info.order, q.size))
        assert d.get("tokens", step=1).tolist() == [13]
        assert d.info("cache_k-0", step=1).shape == (6, 2, 2)
    assert d.closed


def test_only_requested_tensors_are_read(sample, monkeypatch):
    reads = []
    original = h5py.Dataset.__getitem__

    def counting(self, key):
        reads.append(self.name)
        return original(self, key)

    monkeypatch.setattr(h5py.Dataset, "__getitem__", counting)
    with diffrun.open(sample) as d:
        for step in d.steps():
            d.names(step)
        d.info("l_out-1", step=1)
        # the steps' attribute tables only (format version 2), once each
        assert reads == ["/step_0000/_attributes", "/step_0001/_attributes"]
        d.get("l_out-1", step=1)
    assert reads[2:] == ["/step_0001/l_out-1"]


def test_errors_name_the_file_and_dataset(sample, tmp_path):
    with diffrun.open(sample) as d:
        with pytest.raises(diffrun.DumpFormatError, match=r"sample\.h5.*step_0000/Qcur-9"):
            d.get("Qcur-9")
        with pytest.raises(diffrun.DumpFormatError, match=r"step_0007"):
            d.names(step=7)

    missing = tmp_path / "missing.h5"
    with pytest.raises(diffrun.DumpFormatError, match="missing.h5: no such file"):
        diffrun.open(missing)

    text = tmp_path / "notes.h5"
    text.write_text("not hdf5\n")
    with pytest.raises(diffrun.DumpFormatError, match="notes.h5: not a readable HDF5 file"):
        diffrun.open(text)

    cut = tmp_path / "cut.h5"
    cut.write_bytes(sample.read_bytes()[: sample.stat().st_size // 3])
    with pytest.raises(diffrun.DumpFormatError, match="cut.h5"):
        with diffrun.open(cut) as d:
            for step in d.steps():
                for name in d.names(step):
                    d.get(name, step)

    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(diffrun.DumpFormatError, match="foreign.h5: not a diffrun dump"):
        diffrun.open(foreign)

    newer = tmp_path / "newer.h5"
    newer.write_bytes(sample.read_bytes())
    with h5py.File(newer, "r+") as f:
        f.attrs["format_version"] = np.int32(3)
    with pytest.raises(diffrun.DumpFormatError, match="newer.h5: format_version 3 is not supported"):
        diffrun.open(newer)

    # Version 2 holds no variable-length strings: one is refused before it is read.
    vlen = tmp_path / "vlen.h5"
    vlen.write_bytes(sample.read_bytes())
    with h5py.File(vlen, "r+") as f:
        del f.attrs["device"]
        f.attrs.create("device", "sample", dtype=h5py.string_dtype("utf-8"))
    with pytest.raises(diffrun.DumpFormatError,
                       match="vlen.h5: root attribute 'device' is a variable-length string; format version 2"):
        diffrun.open(vlen)

    # A damaged attribute table: a row naming no dataset, a name twice, a variable-length column.
    bad = tmp_path / "table-missing.h5"
    bad.write_bytes(sample.read_bytes())
    with h5py.File(bad, "r+") as f:
        dump_h5.set_attr(f["step_0000"], "nothing-here", "order", 1)
    with diffrun.open(bad) as d:  # ignored by the reader (a dataset deleted afterwards); validate reports it
        assert d.names(0) == vocabulary.checkpoint_names("qwen3", 2)
    problems = [f"{p.where}: {p.what}" for p in diffrun.validate.validate(bad).problems]
    assert problems == ["step_0000/_attributes: names 'nothing-here', which the step does not hold"], problems
    bad = tmp_path / "table-twice.h5"
    bad.write_bytes(sample.read_bytes())
    with h5py.File(bad, "r+") as f:
        g = f["step_0000"]
        t = g["_attributes"][()]
        del g["_attributes"]
        g.create_dataset("_attributes", data=np.concatenate([t, t[1:2]]))
    with pytest.raises(diffrun.DumpFormatError, match="step_0000/_attributes: names 'embd' twice"):
        diffrun.open(bad).names(0)
    bad = tmp_path / "table-vlen.h5"
    bad.write_bytes(sample.read_bytes())
    with h5py.File(bad, "r+") as f:
        g = f["step_0000"]
        t = g["_attributes"][()]
        dt = np.dtype([("name", h5py.string_dtype("utf-8")), ("order", "<i4")])
        rows = np.array([(n.decode(), o) for n, o in zip(t["name"], t["order"])], dtype=dt)
        del g["_attributes"]
        g.create_dataset("_attributes", data=rows)
    with pytest.raises(diffrun.DumpFormatError, match="column 'name' is a variable-length string"):
        diffrun.open(bad).names(0)


def test_version_1_dumps_read_as_before(sample, tmp_path):
    """The old form (format_version 1: per-dataset attributes, variable-length strings) reads exactly
    like the version-2 dump it was made from."""
    old = tmp_path / "v1.h5"
    old.write_bytes(sample.read_bytes())
    dump_h5.to_version_1(old)
    with h5py.File(old, "r") as f:
        assert f.attrs["format_version"] == 1 and "_attributes" not in f["step_0000"]
        assert f.attrs.get_id("arch").get_type().is_variable_str()
        assert f["step_0000/Qnorm-1"].attrs["layout"] == "T,H,Dh"
    with diffrun.open(sample) as new, diffrun.open(old) as d:
        assert d.meta["format_version"] == 1
        def plain(meta):
            return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in meta.items() if k != "format_version"}
        assert plain(d.meta) == plain(new.meta) and d.meta["arch"] == "qwen3"
        assert d.steps() == new.steps()
        for step in d.steps():
            assert [d.info(n, step) for n in d.names(step)] == [new.info(n, step) for n in new.names(step)]
            for name in d.names(step):
                np.testing.assert_array_equal(d.get(name, step), new.get(name, step))


def test_vocabulary_mirror_matches_cpp():
    if not SAMPLE or not os.path.exists(SAMPLE):
        pytest.fail("DIFFRUN_DUMP_SAMPLE must name the built tests/dump_sample program (run through ctest)")
    cpp = json.loads(subprocess.run([SAMPLE, "--vocab-json"], check=True, capture_output=True, text=True).stdout)
    mirror = [
        {"base": k.base, "per_layer": k.per_layer, "layout": k.layout, "archs": list(k.archs)}
        for k in vocabulary.KINDS
    ]
    assert [{key: k[key] for key in ("base", "per_layer", "layout", "archs")} for k in cpp["kinds"]] == mirror


def test_vocabulary_order_matches_the_dump(sample):
    with diffrun.open(sample) as d:
        for name in d.names(0):
            assert d.info(name).order == vocabulary.checkpoint_order("qwen3", 2, name)
    assert vocabulary.checkpoint_names("llama", 1)[:4] == ["tokens", "embd", "attn_norm-0", "Qcur-0"]
    assert "Qnorm-0" not in vocabulary.checkpoint_names("qwen2", 1)
    assert vocabulary.parse_name("kq_soft_max-12") == ("kq_soft_max", 12)
    assert vocabulary.parse_name("result_output") == ("result_output", -1)


def diffrun_bin():
    path = os.environ.get("DIFFRUN_BIN", "")
    if not path or not os.path.exists(path):
        pytest.skip("DIFFRUN_BIN (the built diffrun executable) is not set; run through ctest")
    return path


def test_cli_ls_summarises_by_default(sample):
    out = subprocess.run([diffrun_bin(), "ls", str(sample)], check=True, capture_output=True, text=True).stdout
    assert "backend cpu, precision f32" in out and "argmax   7 13" in out
    assert "Qnorm-1" not in out

    def wrapped(head):  # a list line and its continuation lines (indented by two)
        lines = out.splitlines()
        i = next(i for i, line in enumerate(lines) if line.startswith(head))
        j = i + 1
        while j < len(lines) and lines[j].startswith("  ") and not lines[j].startswith("  step"):
            j += 1
        assert all(len(line) <= 100 for line in lines[i:j]), lines[i:j]
        return " ".join(line.strip() for line in lines[i:j]).split(": ", 1)[1].split(", ")

    names = vocabulary.checkpoint_names("qwen3", 2)
    expected = list(dict.fromkeys(n.rsplit("-", 1)[0] for n in names if n.rsplit("-", 1)[-1].isdigit()))
    assert wrapped("kinds per layer") == expected, out
    # The largest kinds over all steps, as h5py counts their values.
    sizes = {}
    with h5py.File(sample) as f:
        for group in f.values():
            for name, ds in group.items():
                base = name.rsplit("-", 1)[0] if name.rsplit("-", 1)[-1].isdigit() else name
                sizes[base] = sizes.get(base, 0) + ds.size * 4
    largest = wrapped("largest kinds")
    assert len(largest) == min(8, len(sizes)), largest
    top = sorted(sizes.values(), reverse=True)[:len(largest)]
    for item, size in zip(largest, top):
        kind, number, unit = item.split()[:3]
        scale = {"MB": 1e6, "KB": 1e3, "B": 1}[unit]
        assert sizes[kind] == size and float(number) * scale == pytest.approx(size, abs=0.051 * scale), (item, size)


def test_cli_ls_lists_steps_and_checkpoints_in_order(sample):
    out = subprocess.run([diffrun_bin(), "ls", "--all", str(sample)], check=True, capture_output=True, text=True).stdout
    assert "backend cpu, precision f32" in out and "qwen3: 2 layers" in out and "Café ✓" in out
    assert "argmax   7 13" in out and "device   sample" in out
    lines = out.splitlines()
    step1 = lines.index(next(line for line in lines if line.startswith("step 1 (")))
    listed = [line.split()[1] for line in lines[step1 + 2:] if line.strip()]
    assert listed == vocabulary.checkpoint_names("qwen3", 2)
    row = next(line for line in lines[step1:] if " Qnorm-1 " in line).split()
    assert row == ["26", "Qnorm-1", "[1,", "4,", "2]", "T,H,Dh", "float32", "f16"]


def test_cli_show_prints_stats_and_a_slice(sample, tmp_path):
    nan = tmp_path / "nan.h5"
    nan.write_bytes(sample.read_bytes())
    with h5py.File(nan, "r+") as f:
        ds = f["step_0000/ffn_up-1"]
        v = ds[()]
        v[2, 3] = np.nan
        v[4, 0] = np.inf
        ds[...] = v
    out = subprocess.run([diffrun_bin(), "show", str(nan), "ffn_up-1", "--rows", "2", "--cols", "3"],
                         check=True, capture_output=True, text=True).stdout
    order = vocabulary.checkpoint_order("qwen3", 2, "ffn_up-1")
    finite = v[np.isfinite(v)].astype(np.float64)
    assert "shape [5, 12] (T,F)" in out
    assert f"min  {order:<14g} at [0, 0]" in out
    assert "60 values: 58 finite, 1 NaN, 1 Inf" in out
    assert f"std {finite.std():<14.7g}" in out
    assert "first 2 of 5 rows (T) x first 3 of 12 columns (F)" in out
    row1 = next(line for line in out.splitlines() if line.strip().startswith("[1]")).split()
    assert [float(x) for x in row1[1:4]] == pytest.approx(v[1, :3], rel=1e-4)

    bad = subprocess.run([diffrun_bin(), "show", str(sample), "Qcur-9", "--step", "1"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "sample.h5" in bad.stderr and "step_0001/Qcur-9" in bad.stderr


def test_cli_vocab_json_is_the_mirrored_vocabulary():
    out = subprocess.run([diffrun_bin(), "vocab", "--json"], check=True, capture_output=True, text=True).stdout
    assert [k["base"] for k in json.loads(out)["kinds"]] == [k.base for k in vocabulary.KINDS]
