"""Hostile inputs through the built diffrun and the Python package: dumps that reach outside themselves
(links, external storage, virtual datasets), planted temporaries, non-regular outputs, an absurd GGUF
block_count, an engine dump missing a step, and a closed output pipe. Each is refused with one clear
error naming the file (exit 2), or fails the comparison (exit 1), and leaves nothing half-written."""
from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import diffrun
from diffrun.dump import DumpFormatError
from diffrun import validate as pyvalidate

DIFFRUN = os.environ.get("DIFFRUN_BIN", "build/cli/diffrun")
FIXTURES = Path(os.environ.get("DIFFRUN_FIXTURE_DIR", "build/fixtures"))
MODEL = FIXTURES / "tiny-llama-f32.gguf"
SECRET = "diffrun-test-secret-4b1d"


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([DIFFRUN, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def temporaries(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if "tmp-" in p.name)


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Path:
    if not MODEL.exists():
        pytest.skip(f"{MODEL} missing: run ctest -R fixtures_generate first")
    out = tmp_path_factory.mktemp("hostile") / "ref.h5"
    r = run("dump", "--backend", "cpu", "--model", MODEL, "--tokens", "1,17,42", "--steps", "1", "--out", out)
    assert r.returncode == 0, r.stderr
    return out


# -- 1. dumps that reach outside themselves -------------------------------------------------------

def _secret_file(d: Path) -> Path:
    p = d / "secret.txt"
    p.write_text((SECRET + "\n") * 4096)
    return p


def craft(kind: str, ref: Path, d: Path) -> tuple[Path, str]:
    """A copy of `ref` made hostile in one way; returns it and the object path the refusal names."""
    path = d / f"{kind}.h5"
    shutil.copy(ref, path)
    copy = d / "copy.h5"  # what the links point into: a whole dump of the same run
    shutil.copy(ref, copy)
    fifo = d / "fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    with h5py.File(path, "r+") as f:
        g = f["step_0000"]
        shape = g["embd"].shape
        if kind == "external_storage":
            del g["embd"]
            g.create_dataset("embd", shape=shape, dtype="f4",
                             external=[(str(_secret_file(d)), 0, int(np.prod(shape)) * 4)])
            return path, "step_0000/embd"
        if kind == "external_storage_tokens":
            tokens = g["tokens"][()]
            del g["tokens"]
            g.create_dataset("tokens", shape=tokens.shape, dtype="i4",
                             external=[(str(_secret_file(d)), 0, tokens.size * 4)])
            return path, "step_0000/tokens"
        if kind == "external_links_everywhere":
            for s in ("step_0000", "step_0001"):
                for name in list(f[s].keys()):
                    del f[s][name]
                    f[s][name] = h5py.ExternalLink(str(copy), f"/{s}/{name}")
            return path, "step_0000/"
        if kind == "external_link_to_fifo":
            del g["embd"]
            g["embd"] = h5py.ExternalLink(str(fifo), "/x")
            return path, "step_0000/embd"
        if kind == "soft_link":
            del g["embd"]
            g["embd"] = h5py.SoftLink("/step_0001/embd")
            return path, "step_0000/embd"
        if kind == "external_step_group":
            del f["step_0001"]
            f["step_0001"] = h5py.ExternalLink(str(copy), "/step_0001")
            return path, "step_0001"
        if kind == "external_attribute_table":
            del g["_attributes"]
            g["_attributes"] = h5py.ExternalLink(str(copy), "/step_0000/_attributes")
            return path, "step_0000/_attributes"
        if kind in ("virtual", "virtual_fifo"):
            del g["embd"]
            source, maxshape = (str(copy), None) if kind == "virtual" else (str(fifo), (None,) + shape[1:])
            layout = h5py.VirtualLayout(shape=shape, dtype="f4", maxshape=maxshape)
            layout[:] = h5py.VirtualSource(source, "/step_0000/embd", shape=shape, maxshape=maxshape)
            g.create_virtual_dataset("embd", layout)
            return path, "step_0000/embd"
    raise AssertionError(kind)


KINDS = ["external_storage", "external_storage_tokens", "external_links_everywhere", "external_link_to_fifo",
         "soft_link", "external_step_group", "external_attribute_table", "virtual", "virtual_fifo"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_reader_refuses_a_dump_reaching_outside_itself(ref: Path, tmp_path: Path, kind: str):
    path, where = craft(kind, ref, tmp_path)
    # diffrun's C++ reader (compare, show, ls) and validate: exit 2, one line naming the file and the
    # object; never the outside bytes, never a hang on the FIFO.
    for args in (("validate", path), ("compare", path, ref), ("compare", ref, path), ("show", path, "embd"),
                 ("ls", path)):
        r = run(*args, timeout=60)
        assert r.returncode == 2, (args, r.returncode, r.stdout, r.stderr)
        assert SECRET not in r.stdout + r.stderr
        err = r.stderr.strip().splitlines()[-1]
        assert err.startswith("diffrun: error: ") and str(path) in err and where in err, (args, err)
        assert "readers refuse" in err, err
    # The Python package: the reader and diffrun.validate refuse the same way.
    with pytest.raises(DumpFormatError, match="readers refuse") as e:
        with diffrun.open(path) as d:
            for step in d.steps():
                for name in d.names(step):
                    d.get(name, step)
    assert str(path) in str(e.value) and where in str(e.value)
    with pytest.raises(DumpFormatError, match="readers refuse"):
        pyvalidate.validate(path)
    r = subprocess.run([sys.executable, "-m", "diffrun.validate", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and where in r.stderr, r.stderr


# -- 2. temporaries and 3. outputs ------------------------------------------------------------------

def test_a_symlink_planted_at_the_temporary_is_not_written_through(tmp_path: Path):
    if not MODEL.exists():
        pytest.skip(f"{MODEL} missing")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "x.h5"
    # The shell plants the link under its own pid, which `exec` hands to diffrun.
    script = (f'ln -s {victim} {out}.diffrun-tmp-$$ && exec {DIFFRUN} dump --backend cpu --model {MODEL} '
              f'--tokens 1,2 --steps 1 --out {out}')
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "it exists and is a symbolic link" in r.stderr and str(out) in r.stderr, r.stderr
    assert victim.read_text() == "precious\n"
    assert not out.exists()


def test_dump_refuses_an_existing_non_regular_out(tmp_path: Path):
    if not MODEL.exists():
        pytest.skip(f"{MODEL} missing")
    fifo = tmp_path / "fifo.h5"
    os.mkfifo(fifo)
    null = tmp_path / "null.h5"
    null.symlink_to("/dev/null")  # what `--out /dev/null` is, without risking the machine's node
    for out, what in ((fifo, "is a FIFO"), (null, "is a character device"), (tmp_path, "is a directory")):
        r = run("dump", "--backend", "cpu", "--model", MODEL, "--tokens", "1,2", "--steps", "1", "--out", out)
        assert r.returncode == 2, r.stderr
        assert what in r.stderr and str(out) in r.stderr, r.stderr
    assert fifo.is_fifo() and null.is_symlink() and os.path.realpath(null) == "/dev/null"
    assert temporaries(tmp_path) == []


# -- 4. an absurd block_count -----------------------------------------------------------------------

def test_an_absurd_block_count_is_refused_before_anything_sizes_itself_from_it(tmp_path: Path):
    if not MODEL.exists():
        pytest.skip(f"{MODEL} missing")
    data = bytearray(MODEL.read_bytes())
    key = b"llama.block_count"
    at = data.index(key) + len(key)
    assert struct.unpack_from("<I", data, at)[0] == 4  # GGUF uint32
    struct.pack_into("<I", data, at + 4, 100_000_000)
    bad = tmp_path / "huge.gguf"
    bad.write_bytes(data)
    out = tmp_path / "x.h5"
    limit = "ulimit -v 1000000; "  # 1 GB: a run sized from 1e8 blocks would not fit
    for args in (f"dump --backend cpu --model {bad} --tokens 1,2 --steps 1 --out {out}", f"validate --skeleton {bad}"):
        r = subprocess.run(["sh", "-c", limit + f"exec {DIFFRUN} {args}"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        assert "block_count is 100000000 but the file holds the tensors of 2 blocks" in r.stderr, r.stderr
        assert str(bad) in r.stderr
    assert not out.exists() and temporaries(tmp_path) == []


# -- 5. missing steps -------------------------------------------------------------------------------

def test_an_engine_dump_missing_a_step_fails_coverage(ref: Path, tmp_path: Path):
    engine = tmp_path / "engine.h5"
    shutil.copy(ref, engine)
    with h5py.File(engine, "r+") as f:
        del f["step_0000"]
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    r = run("compare", engine, ref, "--report-json", report, "--report-junit", junit, "--no-color")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "RESULT: FAIL: coverage: the engine dump lacks step 0 of the reference" in r.stdout, r.stdout
    cov = json.loads(report.read_text())["coverage"]
    assert cov["missing_steps"] == [0] and cov["met"] is False, cov
    assert 'type="coverage"' in junit.read_text()
    r = run("compare", engine, ref, "--summary")
    assert r.returncode == 1 and r.stdout.startswith("FAIL "), r.stdout
    # The same dumps the other way round (the engine holds a step the reference lacks) and a whole
    # copy are unaffected.
    assert run("compare", ref, ref).returncode == 0


# -- 7. a closed output pipe --------------------------------------------------------------------------

def test_a_closed_output_pipe_removes_the_temporaries(tmp_path: Path):
    if not MODEL.exists():
        pytest.skip(f"{MODEL} missing")
    out = tmp_path / "p.h5"
    # `diffrun dump ... 2>&1 | head -4`: the reader goes away once the first step is done (the writer
    # has its temporary by then); the next progress line meets the closed pipe.
    p = subprocess.Popen([DIFFRUN, "dump", "--backend", "cpu", "--model", str(MODEL), "--tokens", "1,2,3",
                          "--steps", "250", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    while len(lines) < 8:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        if b"step 1/" in line:
            break
    assert any(b"step 1/" in x for x in lines), lines
    assert temporaries(tmp_path), "the dump's temporary exists while it runs"
    p.stdout.close()
    rc = p.wait(timeout=120)
    assert rc == 128 + signal.SIGPIPE, rc
    assert temporaries(tmp_path) == [] and not out.exists()


@pytest.mark.parametrize("args, says", [
    (["--tp", "4096", "m.gguf"], "--tp 4096 asks 4096 GPUs; this machine has"),
    (["--tp", "0", "m.gguf"], "--tp takes a GPU count of at least 1, got '0'"),
    (["--tp", "two", "m.gguf"], "got 'two'"),
    (["--tp"], "--tp takes a GPU count"),
])
def test_the_side_by_side_benchmark_refuses_a_gpu_count_it_cannot_have(args, says):
    # scripts/bench_vs_llamacpp.sh --tp N checks the host's GPUs before it builds or runs anything.
    r = subprocess.run(["scripts/bench_vs_llamacpp.sh", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and says in r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("args, says", [
    (["--llama-bench", "no/such/llama-bench", "m.gguf"], "--llama-bench no/such/llama-bench: no such executable file"),
    (["--llama-bench", "README.md", "m.gguf"], "--llama-bench README.md: no such executable file"),
    (["--llama-bench", "scripts/setup", "--llamacpp-tar", "x.tgz", "m.gguf"],
     "--llama-bench and --llamacpp-tar: give one"),
])
def test_the_side_by_side_benchmark_refuses_a_llama_bench_it_cannot_run(args, says):
    # --llama-bench FILE is checked before anything is built or run.
    r = subprocess.run(["scripts/bench_vs_llamacpp.sh", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and says in r.stderr, r.stdout + r.stderr
