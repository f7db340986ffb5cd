"""Hostile and damaged dumps, name maps and arguments through the built diffrun: compression bombs,
a declared size over the read limit, data that only fails when read (an unknown filter, chunks never
written, a failed checksum), a damaged attribute table, hostile name maps, control characters in
names. Each is refused with one clear error naming the file and what is wrong (exit 2), or reported
by `validate` (exit 1), never a crash, a traceback or gigabytes of memory."""
from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

DIFFRUN = os.environ.get("DIFFRUN_BIN", "build/cli/diffrun")
FIXTURES = Path(os.environ.get("DIFFRUN_FIXTURE_DIR", "build/fixtures"))
MODEL = FIXTURES / "tiny-llama-f32.gguf"
SOURCE = Path(os.environ.get("DIFFRUN_SOURCE_DIR", "."))


def run(*args, timeout: float = 120, env: dict | None = None, mem_mb: int | None = None) -> subprocess.CompletedProcess:
    def limit():
        if mem_mb:
            resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))
    e = dict(os.environ, **(env or {}))
    return subprocess.run([DIFFRUN, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=e,
                          preexec_fn=limit)


def one_error_line(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    for w in words:
        assert w in r.stderr, (w, r.stderr)


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Path:
    if not MODEL.exists():
        pytest.skip(f"{MODEL} missing: run ctest -R fixtures_generate first")
    out = tmp_path_factory.mktemp("hostile_dumps") / "ref.h5"
    r = run("dump", "--backend", "cpu", "--model", MODEL, "--tokens", "1,17,42", "--steps", "1", "--out", out)
    assert r.returncode == 0, r.stderr
    return out


def replace_dataset(path: Path, name: str, shape, dtype="f4", data=None, **kw) -> None:
    with h5py.File(path, "r+") as f:
        g = f["step_0000"]
        del g[name]
        ds = g.create_dataset(name, shape=shape, dtype=dtype, **kw)
        if data is not None:
            ds[...] = data


# -- 1. compression bombs and the read limit ----------------------------------------------------------

def test_a_compression_bomb_is_refused_before_it_is_read(ref: Path, tmp_path: Path):
    bomb = tmp_path / "bomb.h5"
    shutil.copy(ref, bomb)
    # 256 MB of zeros in about 256 kB (about 1000:1): what no real dump compresses to.
    replace_dataset(bomb, "embd", (64, 1 << 20), data=0.0, chunks=(1, 1 << 20), compression="gzip",
                    compression_opts=9, shuffle=True)
    assert bomb.stat().st_size < 2 << 20
    for args in (["show", bomb, "embd"], ["compare", bomb, bomb], ["ls", bomb], ["validate", bomb]):
        r = run(*args, mem_mb=1024)
        one_error_line(r, str(bomb), "step_0000/embd", "compress", ":1")


def test_a_dataset_over_the_read_limit_is_refused(ref: Path, tmp_path: Path):
    big = tmp_path / "big.h5"
    shutil.copy(ref, big)
    replace_dataset(big, "embd", (3, 1 << 19), data=np.ones((3, 1 << 19), np.float32))  # 6 MiB
    for args in (["show", big, "embd"], ["compare", big, ref], ["validate", big]):
        r = run(*args, env={"DIFFRUN_MAX_DATASET_MB": "4"})
        one_error_line(r, str(big), "step_0000/embd", "DIFFRUN_MAX_DATASET_MB")
    # within a raised limit it is read (and is the wrong shape for validate)
    assert run("show", big, "embd", env={"DIFFRUN_MAX_DATASET_MB": "64"}).returncode == 0


# -- 2. the attribute table read without HDF5's struct conversion ---------------------------------------

def rewrite_table(path: Path, dtype: np.dtype, fill) -> None:
    with h5py.File(path, "r+") as f:
        g = f["step_0000"]
        old = g["_attributes"][()]
        del g["_attributes"]
        new = np.zeros(old.shape, dtype)
        for col in dtype.names:
            if col in old.dtype.names:
                new[col] = old[col]
        fill(new)
        g.create_dataset("_attributes", data=new)


def test_an_attribute_table_in_other_types_reads_without_conversion(ref: Path, tmp_path: Path):
    # big-endian 16-bit integers and space-padded columns in another order: decoded from the row bytes
    other = tmp_path / "other_types.h5"
    shutil.copy(ref, other)
    rewrite_table(other, np.dtype([("layer", ">i4"), ("name", "S40"), ("order", ">i4"), ("layout", "S12")]),
                  lambda t: None)
    r = run("validate", other)
    assert r.returncode in (0, 1), r.stderr
    assert run("compare", other, ref).returncode == 0


def test_a_variable_length_table_column_is_refused_unread(ref: Path, tmp_path: Path):
    bad = tmp_path / "vlen_column.h5"
    shutil.copy(ref, bad)
    def notes(t):
        for i in range(len(t)):
            t["note"][i] = np.array([i], np.int32)
    rewrite_table(bad, np.dtype([("name", "S40"), ("order", "<i4"), ("note", h5py.vlen_dtype(np.int32))]), notes)
    r = run("validate", bad)
    assert r.returncode == 1 and "column 'note' holds variable-length data" in r.stdout, (r.stdout, r.stderr)
    one_error_line(run("compare", bad, ref), str(bad), "step_0000/_attributes", "variable-length")


@pytest.mark.parametrize("sample", sorted(p.name for p in (SOURCE / "tests" / "data").glob("fuzz-damaged-*.h5")))
def test_fuzzed_samples_give_an_error_not_a_crash(sample: str):
    path = SOURCE / "tests" / "data" / sample
    for args in (["validate", path], ["ls", path], ["compare", path, path]):
        r = run(*args)
        assert r.returncode in (1, 2), (args, r.returncode, r.stderr)


def test_a_root_attribute_of_several_values_is_refused_where_one_is_read(ref: Path, tmp_path: Path):
    """A real or integer config attribute stored as an array: read into one value, it overflowed the reader's
    buffer (found by fuzz_dump under ASan); it is refused, and validate names it."""
    for name, value in (("rms_eps", np.array([1e-5, 1e-5])), ("rope_theta", np.array([1e4, 1e4, 1e4])),
                        ("n_embd", np.array([256, 256], np.int32))):
        bad = tmp_path / f"{name}.h5"
        shutil.copy(ref, bad)
        with h5py.File(bad, "r+") as f:
            del f.attrs[name]
            f.attrs[name] = value
        one_error_line(run("ls", bad), str(bad), f"attribute '{name}' is not a scalar")
        r = run("validate", bad)
        assert r.returncode == 1 and f"root attribute '{name}': holds {len(value)} values, expected one" in r.stdout, \
            (r.stdout, r.stderr)


# -- 3. validate reads what compare reads -----------------------------------------------------------------

def test_validate_reports_data_compare_cannot_read(ref: Path, tmp_path: Path):
    # an unknown filter (LZF, h5py's own), a damaged deflate chunk, a failed Fletcher32 checksum
    cases = {}
    lzf = tmp_path / "lzf.h5"
    shutil.copy(ref, lzf)
    with h5py.File(ref, "r") as f:
        embd = f["step_0000/embd"][()]
    # (zeros: LZF skips a chunk it cannot shrink, which then reads without the filter)
    replace_dataset(lzf, "embd", embd.shape, data=0.0, compression="lzf", chunks=embd.shape)
    cases[lzf] = "embd"
    for kind, kw in (("deflate", dict(compression="gzip")), ("fletcher32", dict(fletcher32=True))):
        path = tmp_path / f"{kind}.h5"
        shutil.copy(ref, path)
        replace_dataset(path, "embd", embd.shape, data=embd, chunks=embd.shape, **kw)
        with h5py.File(path, "r") as f:
            offset = f["step_0000/embd"].id.get_chunk_info(0).byte_offset
        with open(path, "r+b") as fh:  # damage the chunk's middle
            fh.seek(offset + 200)
            b = fh.read(16)
            fh.seek(offset + 200)
            fh.write(bytes(x ^ 0x5a for x in b))
        cases[path] = "embd"
    for path, name in cases.items():
        c = run("compare", path, ref)
        assert c.returncode == 2, (path, c.stderr)
        r = run("validate", path)
        assert r.returncode == 1, (path, r.stdout, r.stderr)
        assert f"step_0000/{name}: cannot be read" in r.stdout, (path, r.stdout)


def test_validate_refuses_partly_written_chunks_as_compare_does(ref: Path, tmp_path: Path):
    part = tmp_path / "partial.h5"
    shutil.copy(ref, part)
    with h5py.File(ref, "r") as f:
        embd = f["step_0000/embd"][()]
    with h5py.File(part, "r+") as f:
        g = f["step_0000"]
        del g["embd"]
        ds = g.create_dataset("embd", shape=embd.shape, dtype="f4", chunks=(1, embd.shape[1]))
        ds[0] = embd[0]  # one chunk of three written
    for args in (["compare", part, ref], ["validate", part]):
        one_error_line(run(*args), str(part), "step_0000/embd", "bytes are stored")


# -- 4. name maps -------------------------------------------------------------------------------------------

def test_hostile_name_maps_are_refused_clearly(ref: Path, tmp_path: Path):
    maps = {
        "occurrence.json": ('{"rules": [{"match": "x", "to": "embd", "occurrence": "99999999999"}]}', "occurrence"),
        "occurrence_int.json": ('{"rules": [{"match": "x", "to": "embd", "occurrence": 1099511627776}]}', "occurrence 1099511627776"),
        "twice.json": ('{"rules": [{"match": "x", "to": "embd", "to": "tokens"}]}', "given twice"),
        "crop.json": ('{"rules": [{"match": "x", "to": "embd", "crop": ["Z"]}]}', 'crop letter "Z"'),
        "key.json": ('{"rules": [{"match": "x", "to": "embd", "' + "k" * (5 << 20) + '": 1}]}', "bytes, more than"),
        "longkey.json": ('{"rules": [{"match": "x", "to": "embd", "' + "k" * 5000 + '": 1}]}', "unknown key"),
    }
    for name, (text, words) in maps.items():
        p = tmp_path / name
        p.write_text(text)
        r = run("compare", ref, ref, "--names", p, mem_mb=1024)
        one_error_line(r, name, words)
        assert len(r.stderr) < 1000, r.stderr[:300]


# -- 5. smaller items --------------------------------------------------------------------------------------

def test_control_characters_from_a_dump_do_not_reach_the_terminal(ref: Path, tmp_path: Path):
    esc = tmp_path / "esc.h5"
    shutil.copy(ref, esc)
    with h5py.File(esc, "r+") as f:
        f.attrs["evil\x1b[2J"] = np.bytes_(b"fact\x1b]0;title\x07\nnext")
        f.attrs["backend"] = np.bytes_(b"cpu\x1b[31m")
        f["step_0000"].create_dataset("evil\x1b[1m\nname", data=np.zeros(3, np.float32))
    for args in (["ls", esc], ["ls", esc, "--all"], ["validate", esc], ["validate", esc, "--json"],
                 ["show", esc, "embd"], ["show", esc, "evil\x1b[1m\nname"]):
        r = run(*args)
        assert r.returncode in (0, 1), (args, r.stderr)
        assert "\x1b" not in r.stdout + r.stderr and "\x07" not in r.stdout + r.stderr, (args, r.stdout)
    assert "evil\\x1b[1m\\nname" in run("validate", esc).stdout


def test_ls_is_linear_in_foreign_names(ref: Path, tmp_path: Path):
    many = tmp_path / "many.h5"
    shutil.copy(ref, many)
    with h5py.File(many, "r+") as f:
        g = f["step_0001"]
        for i in range(20000):
            g.create_dataset(f"foreign.{i}", data=np.float32(0), track_times=False)
    import time
    t0 = time.monotonic()
    r = run("ls", many)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 20


def test_format_version_out_of_range_is_named(ref: Path, tmp_path: Path):
    v = tmp_path / "v.h5"
    shutil.copy(ref, v)
    with h5py.File(v, "r+") as f:
        f.attrs["format_version"] = np.int32(-1)
    for args in (["ls", v], ["compare", v, ref]):
        one_error_line(run(*args), str(v), "format_version -1 is not supported")
    r = run("validate", v)
    assert r.returncode == 1 and "is -1, this diffrun reads versions 1 to 2" in r.stdout and "is 1:" not in r.stdout


def test_python_validator_errors_without_traceback(tmp_path: Path):
    for path in (tmp_path / "missing.h5", tmp_path / "foreign.h5"):
        if path.name == "foreign.h5":
            path.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)
        r = subprocess.run([sys.executable, "-m", "diffrun.validate", str(path)], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(SOURCE / "python")))
        assert r.returncode == 2 and "Traceback" not in r.stderr and str(path) in r.stderr, r.stderr


# -- 6., 7. CLI consistency and swapped arguments -------------------------------------------------------

def test_show_accepts_no_color_and_dump_takes_threads(ref: Path, tmp_path: Path):
    assert run("show", ref, "embd", "--no-color").returncode == 0
    out = tmp_path / "t.h5"
    prompt = ",".join(str(1 + i % 50) for i in range(40))
    r = run("dump", "--backend", "cpu", "--model", MODEL, "--tokens", prompt, "--steps", "1", "--threads", "1",
            "--checkpoints", "embd", "--out", out)
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert "41 tokens: 1 2 3 4 5 6 7 8 ..." in last and len(last) < 200, last


def test_swapped_compare_arguments_are_named(ref: Path, tmp_path: Path):
    f64 = tmp_path / "f64.h5"
    r = run("dump", "--backend", "cpu", "--precision", "f64", "--model", MODEL, "--tokens", "1,17,42", "--steps", "1",
            "--out", f64)
    assert r.returncode == 0, r.stderr
    assert run("compare", ref, f64).returncode in (0, 1)
    one_error_line(run("compare", f64, ref), "look swapped", "engine dump first")
