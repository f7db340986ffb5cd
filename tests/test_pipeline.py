# The pipelined top-level job: the same reports with --dump full, divergence and none, as `diffrun compare` of the full dumps; --stop-at-first; --threads.
import json
import os
import re
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

import dump_h5

DIFFRUN = os.environ.get("DIFFRUN_BIN", "build/cli/diffrun")
FIXTURES = Path(os.environ.get("DIFFRUN_FIXTURE_DIR", "build/fixtures"))
MODEL = FIXTURES / "tiny-llama-f32.gguf"
# kv_cache_pos0 first shows at cache_k-0 of step 1 (diffrun faults): a divergence with steps on both sides.
JOB = ["-m", str(MODEL), "--tokens", "1,2,3,4,5,6", "--steps", "4", "--engine", "cpu", "--no-color", "--threads", "1"]


def run(*args):
    return subprocess.run([DIFFRUN, *args], capture_output=True, text=True)


def job(tmp, name, *extra):
    """The main job with every report; returns (exit code, terminal, JSON, JUnit, out dir)."""
    out = tmp / name
    base = JOB
    if "--tokens" in extra:
        i = JOB.index("--tokens")
        base = JOB[:i] + JOB[i + 2:]
    r = run(*base, *extra, "--out", str(out), "--report-json", str(tmp / f"{name}.json"), "--report-junit",
            str(tmp / f"{name}.xml"))
    assert r.returncode in (0, 1), r.stdout + r.stderr
    return r.returncode, r.stdout, (tmp / f"{name}.json").read_text(), (tmp / f"{name}.xml").read_text(), out


def normalized(text, out):
    """A report with what differs between runs blanked: the dump paths, the run id, the creation time."""
    text = re.sub(r"not written \(--dump \w+\)", "<dump>", text)
    text = re.sub(re.escape(str(out)) + r"(/logic|/precision)?/(engine|reference|engine-isolated)\.h5", "<dump>", text)
    text = re.sub(r'"run_id": "[^"]*"', '"run_id": ""', text)
    text = re.sub(r'"created_utc": "[^"]*"', '"created_utc": ""', text)
    text = re.sub(r'timestamp="[^"]*"', 'timestamp=""', text)
    text = re.sub(r'time="[^"]*"', 'time=""', text)
    return text


def steps_with_checkpoints(path):
    with h5py.File(path, "r") as f:
        return {int(k[5:]): sorted(n for n in f[k].keys() if n != "_attributes") for k in f.keys()}


LONG = ",".join(str(1 + i % 1400) for i in range(80))  # a prompt past the writers' row cuts


@pytest.mark.parametrize("fault,cut", [("kv_cache_pos0", []), (None, []), ("kv_cache_pos0", ["--softmax-rows", "2"]),
                                       ("kv_cache_pos0", ["--tokens", LONG])])
def test_every_dump_mode_gives_the_same_reports(tmp_path, fault, cut):
    # cut: what a writer stores differs from what a backend records (kq_soft_max's last rows, a long
    # prompt): the streamed comparison must compare what the dumps hold.
    extra = (["--inject", fault] if fault else []) + cut
    runs = {mode: job(tmp_path, mode, "--dump", mode, *extra) for mode in ("full", "divergence", "none")}
    code, terminal, js, junit, out = runs["full"]
    assert code == (1 if fault else 0)
    for mode in ("divergence", "none"):
        c, t, j, x, o = runs[mode]
        assert c == code
        # The terminal report wraps at 100 columns, where the path's length says: compare the words.
        assert normalized(t, o).split() == normalized(terminal, out).split(), mode
        assert normalized(j, o) == normalized(js, out), mode
        assert normalized(x, o) == normalized(junit, out), mode
    assert not runs["none"][4].exists() or not list(runs["none"][4].glob("*.h5"))

    # The streamed comparison is the comparison of the full dumps.
    r = run("compare", str(out / "engine.h5"), str(out / "reference.h5"), "--no-color", "--require-coverage", "100",
            "--report-json", str(tmp_path / "compare.json"))
    assert r.returncode == code, r.stdout + r.stderr
    streamed, read = json.loads(js), json.loads((tmp_path / "compare.json").read_text())
    for side in ("engine", "reference"):
        streamed[side]["path"] = read[side]["path"] = ""
    # A difference here: the comparator (cli/pipeline.cpp, info_of) does not cut a checkpoint's rows
    # as the dump writer stores them.
    assert streamed == read

    # Full: every step holds every checkpoint. Divergence: every step its tokens, the checkpoints only
    # around the first divergence (steps 0, 1, 2 for step 1), or none without one.
    full = steps_with_checkpoints(out / "engine.h5")
    assert sorted(full) == [0, 1, 2, 3, 4] and all(len(v) > 1 for v in full.values())
    if cut[:1] == ["--softmax-rows"]:
        with h5py.File(out / "engine.h5", "r") as f:
            assert dump_h5.attrs(f, 0, "kq_soft_max-0")["row_offset"] == 4
    for side in ("engine.h5", "reference.h5"):
        div = steps_with_checkpoints(runs["divergence"][4] / side)
        assert sorted(div) == [0, 1, 2, 3, 4]
        window = {0, 1, 2} if fault else set()
        for step, names in div.items():
            assert names == (full[step] if step in window else ["tokens"]), (side, step)
    v = run("validate", str(runs["divergence"][4] / "engine.h5"))
    assert v.returncode == 0, v.stdout + v.stderr


@pytest.mark.parametrize("extra", [[], ["--isolate"], ["--dump", "divergence"], ["--tokens", LONG, "--token-rows", "8"],
                                   ["--stop-at-first", "0"]])
def test_spare_cores_work_gives_the_same_reports_and_dumps(tmp_path, extra, monkeypatch):
    # With many cores the job writes each dump on a thread and from a process of its own, lets a side
    # run ahead in a step and a backend into later steps (--stop-at-first then ends steps it may have
    # started), and compares checkpoints in parallel batches (DIFFRUN_SPARE_CORES=1 forces it, 0 turns
    # it off): the same reports, the same dumps value for value.
    runs = {}
    for spare in ("0", "1"):
        monkeypatch.setenv("DIFFRUN_SPARE_CORES", spare)
        runs[spare] = job(tmp_path, f"spare{spare}", "--inject", "kv_cache_pos0", *extra)
    monkeypatch.delenv("DIFFRUN_SPARE_CORES")
    a, b = runs["0"], runs["1"]
    assert a[0] == b[0] == 1
    assert normalized(a[1], a[4]).split() == normalized(b[1], b[4]).split()
    assert normalized(a[2], a[4]) == normalized(b[2], b[4])
    assert normalized(a[3], a[4]) == normalized(b[3], b[4])
    names = sorted(p.name for p in a[4].glob("*.h5"))
    assert names == sorted(p.name for p in b[4].glob("*.h5")) and "engine.h5" in names
    for name in names:
        x, y = datasets(a[4] / name), datasets(b[4] / name)
        assert x.keys() == y.keys() and len(x) > 0, name
        for key in x:
            assert np.array_equal(x[key], y[key], equal_nan=x[key].dtype.kind == "f"), (name, key)


@pytest.mark.parametrize("after", [0, 2])
def test_stop_at_first_ends_the_run_after_the_divergence(tmp_path, after):
    code, terminal, js, _, out = job(tmp_path, "stop", "--inject", "kv_cache_pos0", "--stop-at-first", str(after))
    assert code == 1
    report = json.loads(js)
    assert (report["first_divergence"]["name"], report["first_divergence"]["step"]) == ("cache_k-0", 1)
    last = 1 + after
    assert {c["step"] for c in report["checkpoints"]} == set(range(last + 1))
    assert [t["step"] for t in report["tokens"]] == list(range(last + 1))
    for side in ("engine.h5", "reference.h5"):
        assert sorted(steps_with_checkpoints(out / side)) == list(range(last + 1))
        with h5py.File(out / side, "r") as f:
            assert len(f.attrs["argmax"]) == last + 1
            assert len(f.attrs["all_token_ids"]) == 6 + last
    # Without a value: the step of the divergence itself.
    code, _, js, _, _ = job(tmp_path, "stop_default", "--inject", "kv_cache_pos0", "--stop-at-first")
    assert code == 1 and {c["step"] for c in json.loads(js)["checkpoints"]} == {0, 1}
    # A run without a divergence runs every step.
    code, _, js, _, _ = job(tmp_path, "stop_clean", "--stop-at-first", "0")
    assert code == 0 and {c["step"] for c in json.loads(js)["checkpoints"]} == {0, 1, 2, 3, 4}


def test_threads_reach_the_reference(tmp_path):
    r = run(*JOB[:-2], "--threads", "2", "--dump", "none", "--report-json", str(tmp_path / "t.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "t.json").read_text())["reference"]["facts"]["cpu_threads"] == "2"


def test_isolate_gives_the_same_reports_in_every_mode(tmp_path):
    # The replay reads the reference's full dump: a temporary one with --dump divergence or none.
    runs = {mode: job(tmp_path, mode, "--dump", mode, "--isolate", "--inject", "kv_cache_pos0")
            for mode in ("full", "divergence", "none")}
    code, terminal, js, junit, out = runs["full"]
    assert code == 1 and "in isolation replay" in terminal
    for mode in ("divergence", "none"):
        c, t, j, x, o = runs[mode]
        assert c == code
        assert normalized(t, o).split() == normalized(terminal, out).split(), mode
        assert normalized(j, o) == normalized(js, out), mode
        assert normalized(x, o) == normalized(junit, out), mode
    assert sorted(p.name for p in runs["divergence"][4].iterdir()) == ["engine.h5", "reference.h5"]
    assert not runs["none"][4].exists() or not list(runs["none"][4].iterdir())
    r = run(*JOB, "--dump", "partial", "--out", str(tmp_path / "bad"))
    assert r.returncode == 2 and "--dump" in r.stderr, r.stderr


def datasets(path):
    """Every dataset of a dump by "step/name", its values as stored."""
    with h5py.File(path, "r") as f:
        return {f"{k}/{n}": f[k][n][()] for k in f.keys() for n in f[k].keys() if n != "_attributes"}


def without_paths(report):
    report = json.loads(report)
    for side in ("engine", "reference"):
        report[side]["path"] = ""
    report["isolated_path"] = ""
    return report


@pytest.mark.parametrize("cut", [[], ["--tokens", LONG, "--token-rows", "8"], ["--stop-at-first", "0"]])
def test_isolation_from_memory_is_the_replay_of_the_dump(tmp_path, cut, monkeypatch):
    # The job replays from the reference's checkpoints held in memory (no dump read back); with
    # DIFFRUN_ISOLATION_HOLD_MAX=0 from the reference's dump file, as before. The same reports, the
    # same isolated dump, and `compare --isolated` of the written dumps gives the same report too.
    # cut: a long prompt whose per-token checkpoints the dumps keep the last 8 rows of (those are
    # not replaced: the reference holds only part of them); or a run ended at its first divergence
    # (step 1), whose replay covers steps 0-1 only.
    extra = ["--dump", "full", "--isolate", "--inject", "kv_cache_pos0", *cut]
    held = job(tmp_path, "held", *extra)
    monkeypatch.setenv("DIFFRUN_ISOLATION_HOLD_MAX", "0")
    read = job(tmp_path, "read", *extra)
    monkeypatch.delenv("DIFFRUN_ISOLATION_HOLD_MAX")
    assert held[0] == read[0] == 1
    assert normalized(held[1], held[4]).split() == normalized(read[1], read[4]).split()
    assert normalized(held[2], held[4]) == normalized(read[2], read[4])
    assert normalized(held[3], held[4]) == normalized(read[3], read[4])
    a, b = datasets(held[4] / "engine-isolated.h5"), datasets(read[4] / "engine-isolated.h5")
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        assert np.array_equal(a[key], b[key], equal_nan=a[key].dtype.kind == "f"), key
    out = held[4]
    r = run("compare", str(out / "engine.h5"), str(out / "reference.h5"), "--isolated", str(out / "engine-isolated.h5"),
            "--no-color", "--require-coverage", "100", "--report-json", str(tmp_path / "compare.json"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert without_paths((tmp_path / "compare.json").read_text()) == without_paths(held[2])


def test_cuda_isolation_beside_the_pipeline_is_the_replay_of_the_dump(tmp_path, monkeypatch):
    # On a CUDA engine the precision pair's replay runs beside the pipeline on a second engine, on the
    # reference's checkpoints held in memory; DIFFRUN_ISOLATION_HOLD_MAX=0 replays from the
    # reference's dump after the pipeline (the path before). The same reports in --dump full and
    # none, the same isolated dump bit for bit.
    base = ["-m", str(MODEL), "--tokens", "1,2,3,4,5,6", "--steps", "4", "--engine", "cuda", "--no-color",
            "--inject", "kv_cache_pos0"]
    first = run(*base, "--dump", "none")
    if first.returncode == 2 and ("without the CUDA engine" in first.stderr or "CUDA device" in first.stderr):
        pytest.skip(first.stderr.strip().splitlines()[-1])
    runs = {}
    for mode in ("full", "none"):
        for how, limit in (("beside", None), ("file", "0")):
            if limit is None:
                monkeypatch.delenv("DIFFRUN_ISOLATION_HOLD_MAX", raising=False)
            else:
                monkeypatch.setenv("DIFFRUN_ISOLATION_HOLD_MAX", limit)
            name = f"{how}-{mode}"
            out = tmp_path / name
            r = run(*base, "--dump", mode, "--out", str(out), "--report-json", str(tmp_path / f"{name}.json"),
                    "--report-junit", str(tmp_path / f"{name}.xml"))
            assert r.returncode == 1, r.stdout + r.stderr
            assert "runs after the pipeline" not in r.stderr, r.stderr
            runs[name] = (r.stdout, (tmp_path / f"{name}.json").read_text(), (tmp_path / f"{name}.xml").read_text(), out)
    monkeypatch.delenv("DIFFRUN_ISOLATION_HOLD_MAX", raising=False)
    full = runs["beside-full"]
    assert "in isolation replay" in full[0]
    for name, (t, j, x, o) in runs.items():
        assert normalized(t, o).split() == normalized(full[0], full[3]).split(), name
        assert normalized(j, o) == normalized(full[1], full[3]), name
        assert normalized(x, o) == normalized(full[2], full[3]), name
    a = datasets(runs["beside-full"][3] / "precision" / "engine-isolated.h5")
    b = datasets(runs["file-full"][3] / "precision" / "engine-isolated.h5")
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        assert np.array_equal(a[key], b[key], equal_nan=a[key].dtype.kind == "f"), key


def dump_contents(path):
    """A dump as comparable data: root attributes but the run's own, every attribute table, every dataset."""
    with h5py.File(path, "r") as f:
        root = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in f.attrs.items()
                if k not in ("created_utc", "run_id")}
        tables = {k: f[k]["_attributes"][()].tolist() for k in f.keys()}
        values = {f"{k}/{n}": f[k][n][()] for k in f.keys() for n in f[k].keys() if n != "_attributes"}
    return root, tables, values


def test_dump_processes_write_the_same_files(tmp_path, monkeypatch):
    # With spare cores each dump is written from a diffrun-dump-child process (HDF5 serializes the
    # calls of one process); DIFFRUN_DUMP_PROCESSES=0 writes them in the job's own process. A wrapper
    # named by DIFFRUN_DUMP_CHILD logs each start, so the test knows the children wrote the files.
    child = Path(DIFFRUN).parent / "diffrun-dump-child"
    assert os.access(child, os.X_OK), f"{child} is built with diffrun"
    log = tmp_path / "children.log"
    wrapper = tmp_path / "child.sh"
    wrapper.write_text(f"#!/bin/sh\necho started >> {log}\nexec {child.resolve()}\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("DIFFRUN_SPARE_CORES", "1")
    monkeypatch.setenv("DIFFRUN_DUMP_CHILD", str(wrapper))
    runs = {}
    for processes in ("0", "1"):
        monkeypatch.setenv("DIFFRUN_DUMP_PROCESSES", processes)
        runs[processes] = job(tmp_path, f"processes{processes}", "--inject", "kv_cache_pos0", "--isolate")
    a, b = runs["0"], runs["1"]
    names = sorted(p.relative_to(a[4]).as_posix() for p in a[4].rglob("*.h5"))
    assert names == sorted(p.relative_to(b[4]).as_posix() for p in b[4].rglob("*.h5")) and len(names) >= 3, names
    assert log.read_text().split() == ["started"] * len(names), "one child per dump, and none without processes"
    assert not [p for p in b[4].rglob("*") if "tmp-" in p.name]
    assert normalized(a[2], a[4]) == normalized(b[2], b[4])
    for name in names:
        (ra, ta, va), (rb, tb, vb) = dump_contents(a[4] / name), dump_contents(b[4] / name)
        assert ra.keys() == rb.keys() and all(np.array_equal(ra[k], rb[k]) for k in ra), name
        assert ta == tb, name
        assert va.keys() == vb.keys() and len(va) > 0, name
        for key in va:
            assert va[key].dtype == vb[key].dtype and np.array_equal(va[key], vb[key], equal_nan=va[key].dtype.kind == "f"), (name, key)


def job_with_draft(tmp, base, draft, monkeypatch):
    """The job under DIFFRUN_DRAFT=draft ("" the default): (terminal, JSON report, out dir, stderr)."""
    monkeypatch.setenv("DIFFRUN_DRAFT", draft)
    out = tmp / f"draft{draft or 'default'}"
    r = run(*base, "--out", str(out), "--report-json", str(tmp / f"{out.name}.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout, (tmp / f"{out.name}.json").read_text(), out, r.stderr


def assert_same_runs(a, b, at_least):
    """Two job_with_draft runs: the same reports, and every dump equal byte for byte (the same files, root attributes,
    attribute tables and datasets)."""
    assert normalized(a[0], a[2]).split() == normalized(b[0], b[2]).split()
    assert normalized(a[1], a[2]) == normalized(b[1], b[2])
    a, b = a[2], b[2]
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*.h5"))
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*.h5")) and len(names) >= at_least, names
    for name in names:
        assert_same_dump(a / name, b / name)


def assert_same_dump(a, b):
    """Two dumps equal byte for byte: root attributes (but the run's own), attribute tables, datasets."""
    (ra, ta, va), (rb, tb, vb) = dump_contents(a), dump_contents(b)
    assert ra.keys() == rb.keys() and all(np.array_equal(ra[k], rb[k]) for k in ra), a
    assert ta == tb and va.keys() == vb.keys() and len(va) > 0, a
    for key in va:
        assert va[key].dtype == vb[key].dtype and va[key].tobytes() == vb[key].tobytes(), (a, key)


@pytest.mark.parametrize("model", ["tiny-llama-kmix.gguf", "tiny-gemma3-q8_0.gguf", "tiny-qwen3moe-q8_0.gguf"])
def test_a_draft_gives_the_same_reports_and_dumps(tmp_path, model, monkeypatch):
    # With a draft of the decode steps' tokens (the first engine's own greedy choices; DIFFRUN_DRAFT=1 takes a CPU
    # engine's too) the reference computes those steps in one pass and replays them: the same reports and dumps as
    # one step at a time, and the timeline says how many steps came out of passes.
    base = ["-m", str(FIXTURES / model), *JOB[2:JOB.index("--steps")], "--steps", "7", *JOB[JOB.index("--steps") + 2:]]
    a, b = (job_with_draft(tmp_path, base, draft, monkeypatch) for draft in ("0", "1"))
    assert_same_runs(a, b, 2)
    timeline = subprocess.run([DIFFRUN, *base, "--dump", "none"], capture_output=True, text=True,
                              env={**os.environ, "DIFFRUN_DRAFT": "1", "DIFFRUN_PROGRESS_TIMES": "1",
                                   "DIFFRUN_SPARE_CORES": "0"}).stderr
    # Without spare cores the reference records at most 32 checkpoints ahead of its engine, which publishes the draft
    # before it records step 1: from step 2 on at the latest, every step comes out of a pass.
    passes = re.search(r"reference cpu/f64: (\d+) of 7 decode steps out of passes over the draft", timeline)
    assert passes and int(passes.group(1)) >= 5, timeline
    # Injected faults: no draft, the steps one at a time as before.
    faulty = subprocess.run([DIFFRUN, *JOB, "--inject", "kv_cache_pos0", "--dump", "none"], capture_output=True,
                            text=True, env={**os.environ, "DIFFRUN_DRAFT": "1", "DIFFRUN_PROGRESS_TIMES": "1"})
    assert faulty.returncode == 1 and "passes over the draft" not in faulty.stderr, faulty.stderr


@pytest.mark.parametrize("model", ["tiny-gemma3-kmix.gguf", "tiny-qwen3moe-q8_0.gguf"])
def test_cuda_engine_draft_gives_the_same_reports_and_dumps(tmp_path, model, monkeypatch):
    # The first CUDA engine drafts by default (its own greedy tokens, after its recorded prefill, then its prefill
    # again): both pairs' reports and every dump as with DIFFRUN_DRAFT=0, and the references' steps out of passes.
    base = ["-m", str(FIXTURES / model), "--tokens", "1,2,3,4,5,6", "--steps", "6", "--engine", "cuda", "--no-color"]
    first = run(*base, "--dump", "none")
    if first.returncode == 2 and ("without the CUDA engine" in first.stderr or "CUDA device" in first.stderr):
        pytest.skip(first.stderr.strip().splitlines()[-1])
    monkeypatch.setenv("DIFFRUN_SPARE_CORES", "0")
    monkeypatch.setenv("DIFFRUN_PROGRESS_TIMES", "1")
    a, b = (job_with_draft(tmp_path, base, draft, monkeypatch) for draft in ("0", ""))
    assert "passes over the draft" not in a[3]
    for ref in ("f64", "f32-f16store"):
        passes = re.search(rf"reference cpu/{ref}: (\d+) of 6 decode steps out of passes over the draft", b[3])
        assert passes and int(passes.group(1)) >= 5, b[3]
    assert_same_runs(a, b, 4)


def test_a_dump_process_that_fails_stops_the_job_cleanly(tmp_path, monkeypatch):
    # A writer process that ends without a word (here: one that exits at once) is an error naming the
    # dump and the process: exit 2, and no temporary or half-written dump is left.
    wrapper = tmp_path / "child.sh"
    wrapper.write_text("#!/bin/sh\nexit 3\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("DIFFRUN_SPARE_CORES", "1")
    monkeypatch.setenv("DIFFRUN_DUMP_PROCESSES", "1")
    monkeypatch.setenv("DIFFRUN_DUMP_CHILD", str(wrapper))
    out = tmp_path / "out"
    r = run(*JOB, "--out", str(out))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "the dump writer process" in r.stderr and "exited with status 3" in r.stderr and ".h5" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "terminate called" not in r.stderr
    assert not list(out.rglob("*.h5")) and not [p for p in out.rglob("*") if "tmp-" in p.name]


def near_tied_router(tmp, src="tiny-mixtral-f32.gguf"):
    """tiny-mixtral with near ties in layer 0's router: expert 3 gets expert 2's row u, but for one column one f32
    ulp apart, so their logits differ by x_c times that ulp: resolved by the f64 reference, lost in the f32 engine's
    rounding. Where one of experts 0 and 1 ranks above the pair and the other below (the model uses 2 of 4), the two
    sides break the tie otherwise on some tokens: routing flips by drift, after which the flipped token runs another
    expert (an FFN of other weights) on each side."""
    gguf = pytest.importorskip("gguf")
    import shutil
    path = tmp / "near-tied-router.gguf"
    shutil.copy(FIXTURES / src, path)
    reader = gguf.GGUFReader(path, "r+")
    w = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_inp.weight").data  # [E, D], a view of the file
    assert w.dtype == np.float32 and w.shape[0] == 4, (w.dtype, w.shape)
    u = np.array(w[2])
    w[3] = u
    w[3, 0] = np.nextafter(u[0], np.float32(np.inf))
    reader.data.flush()
    del reader
    return path


TIED_JOB = ["--steps", "3", "--engine", "cpu", "--no-color", "--threads", "1"]
TIED_TOKENS = ",".join(str(3 + (7 * i) % 250) for i in range(24))


@pytest.mark.parametrize("isolate", [[], ["--isolate"]])
def test_a_routing_flip_by_drift_is_followed_and_passes(tmp_path, isolate):
    # The first run diverges after the flips (the flipped tokens' ffn_moe_out is another expert's); the pair runs
    # again with the reference taking the engine's experts there, and passes: no false alarm from a near tie. Under
    # isolation the engine replayed on the reference's probabilities chooses the reference's own experts, not the
    # followed ones: no local error where the reference followed.
    model = near_tied_router(tmp_path)
    out, js = tmp_path / "out", tmp_path / "report.json"
    r = run("-m", str(model), "--tokens", TIED_TOKENS, *TIED_JOB, *isolate, "--out", str(out), "--report-json",
            str(js))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "running the pair again with the reference following the engine's experts" in r.stderr, r.stderr
    assert "ROUTING  followed" in r.stdout, r.stdout
    report = json.loads(js.read_text())
    followed = report["routing"]["followed"]
    assert followed and all(f["kind"] == "drift" and f["layer"] == 0 for f in followed), followed
    assert all(sorted(f["engine"]) != sorted(f["reference"]) or f["reordered"] for f in followed), followed
    assert all(abs(f["gap"]) <= 2 * f["router_error"] for f in followed), followed
    # The reference's dump holds the experts it ran, and says which it followed: `compare` of the dumps reports the
    # same comparison, the followed flips from the fact.
    with h5py.File(out / "reference.h5", "r") as f:
        fact = f.attrs["routing_followed"]
        fact = fact.decode() if isinstance(fact, bytes) else str(fact)
    assert fact.count("step ") == len(followed), fact
    c = run("compare", str(out), "--no-color", "--report-json", str(tmp_path / "compare.json"))
    assert c.returncode == 0, c.stdout + c.stderr
    again = json.loads((tmp_path / "compare.json").read_text())["routing"]["followed"]
    assert [(f["step"], f["layer"], f["token"], f["engine"]) for f in again] == \
           [(f["step"], f["layer"], f["token"], f["engine"]) for f in followed]


@pytest.mark.parametrize("fault,checkpoint,step", [("moe_expert_id_off_by_one", "ffn_moe_topk-0", 0),
                                                   ("kv_cache_pos0", "cache_k-0", 1)])
def test_a_bug_beside_routing_flips_by_drift_is_still_found(tmp_path, fault, checkpoint, step):
    # A routing bug is a local flip: nothing is followed. A bug after the followed flips (the decode steps' cache
    # write) shows in the run again, at its own checkpoint and step.
    model = near_tied_router(tmp_path)
    js = tmp_path / "report.json"
    r = run("-m", str(model), "--tokens", TIED_TOKENS, *TIED_JOB, "--inject", fault, "--out", str(tmp_path / "out"),
            "--report-json", str(js))
    assert r.returncode == 1, r.stdout + r.stderr
    first = json.loads(js.read_text())["first_divergence"]
    assert (first["name"], first["step"], first["verdict"]["kind"]) == (checkpoint, step, "local"), first


def test_a_reference_follows_an_outside_engines_routing_flips(tmp_path):
    # An engine's own dump of the near-tied router (here the cpu backend at f32 stands in for it) against the f64
    # reference made with --follow-routing: fed the engine's tokens, run again where the engine chose otherwise across
    # a near tie; compare passes and lists the followed rows. A bug beside the flips is still found.
    model = near_tied_router(tmp_path)
    common = ["-m", str(model), "--tokens", TIED_TOKENS, "--steps", "3"]
    for name, extra in (("mine", []), ("mine-bug", ["--inject", "kv_cache_pos0"])):
        r = run("dump", "--backend", "cpu", "--precision", "f32", *common, *extra, "--out", str(tmp_path / f"{name}.h5"))
        assert r.returncode == 0, r.stdout + r.stderr
        r = run("dump", "--backend", "cpu", "--precision", "f64", *common, "--follow-routing",
                str(tmp_path / f"{name}.h5"), "--out", str(tmp_path / f"ref-{name}.h5"))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "running again with the engine's experts there" in r.stderr, r.stderr
        assert re.search(r"followed [1-9]\d* routing flips? by drift", r.stdout), r.stdout
    js = tmp_path / "compare.json"
    c = run("compare", str(tmp_path / "mine.h5"), str(tmp_path / "ref-mine.h5"), "--no-color", "--report-json", str(js))
    assert c.returncode == 0, c.stdout + c.stderr
    assert "ROUTING  followed" in c.stdout, c.stdout
    followed = json.loads(js.read_text())["routing"]["followed"]
    assert followed and all(f["layer"] == 0 and f["kind"] == "drift" for f in followed), followed
    c = run("compare", str(tmp_path / "mine-bug.h5"), str(tmp_path / "ref-mine-bug.h5"), "--no-color", "--report-json",
            str(js))
    assert c.returncode == 1, c.stdout + c.stderr
    first = json.loads(js.read_text())["first_divergence"]
    assert (first["name"], first["step"], first["verdict"]["kind"]) == ("cache_k-0", 1, "local"), first


def test_dump_feed_is_teacher_forcing_on_a_dump(tmp_path):
    # dump --feed REF: REF's prompt, and at each decode step REF's token instead of the backend's own argmax, so that
    # diffrun's backends run as an outside engine is run. Here a fault that changes the argmax: the fed dump still
    # holds REF's tokens, its own argmax differs. What it cannot feed is refused, exit 2, naming it.
    import h5py
    model = FIXTURES / "tiny-llama-f32.gguf"
    ref = tmp_path / "ref.h5"
    assert run("dump", "-m", str(model), "--backend", "cpu", "--tokens", "1,5,9,13", "--steps", "3", "--out",
               str(ref)).returncode == 0
    fed = tmp_path / "fed.h5"
    r = run("dump", "-m", str(model), "--backend", "cpu", "--precision", "f32", "--inject", "attn_scale_missing",
            "--feed", str(ref), "--out", str(fed))
    assert r.returncode == 0, r.stdout + r.stderr
    with h5py.File(ref, "r") as a, h5py.File(fed, "r") as b:
        assert list(b.attrs["all_token_ids"]) == list(a.attrs["all_token_ids"])
        assert list(b.attrs["token_ids"]) == [1, 5, 9, 13]
        assert list(b.attrs["argmax"]) != list(a.attrs["argmax"]), "the fault should change the engine's own argmax"
    c = run("compare", str(fed), str(ref), "--no-color", "--summary")
    assert c.returncode == 1 and "DIVERGED" in c.stdout, c.stdout + c.stderr
    no_tokens = tmp_path / "no-tokens.h5"
    no_tokens.write_bytes(ref.read_bytes())
    with h5py.File(no_tokens, "a") as f:
        del f.attrs["all_token_ids"]
    cases = [
        (["--tokens", "1,5,9", "--feed", str(ref)], "is not this one"),
        (["--feed", str(ref), "--steps", "5"], "holds the tokens of 3 decode steps"),
        (["--feed", str(ref), "--replay", str(ref)], "give one"),
        (["--feed", str(tmp_path / "missing.h5")], "missing.h5"),
        (["--feed", str(no_tokens)], "no root attribute all_token_ids"),
    ]
    for args, says in cases:
        r = run("dump", "-m", str(model), "--backend", "cpu", *args, "--out", str(tmp_path / "x.h5"))
        assert r.returncode == 2 and says in r.stderr, (args, r.stdout + r.stderr)


@pytest.mark.parametrize("model", ["tiny-gemma3-kmix.gguf", "tiny-qwen3moe-q8_0.gguf"])
def test_dump_feed_computes_the_fed_steps_in_passes(tmp_path, model, monkeypatch):
    # dump --feed knows every decode step's token before the run: the reference computes them in passes (the tokens
    # fed are its draft), and writes the same dump as one step at a time (DIFFRUN_DRAFT=0).
    ref = tmp_path / "engine.h5"
    assert run("dump", "-m", str(FIXTURES / model), "--backend", "cpu", "--precision", "f32", "--tokens", "1,5,9,13",
               "--steps", "6", "--out", str(ref)).returncode == 0
    dumps = {}
    for draft in ("0", ""):
        monkeypatch.setenv("DIFFRUN_DRAFT", draft)
        dumps[draft] = tmp_path / f"reference{draft or 'default'}.h5"
        r = run("dump", "-m", str(FIXTURES / model), "--backend", "cpu", "--precision", "f64", "--feed", str(ref),
                "--out", str(dumps[draft]))
        assert r.returncode == 0, r.stdout + r.stderr
        assert ("6 of 6 decode steps computed in passes over the fed tokens" in r.stderr) == (draft == ""), r.stderr
    assert_same_dump(dumps["0"], dumps[""])


def test_follow_routing_refuses_what_it_cannot_follow(tmp_path):
    model = near_tied_router(tmp_path)
    common = ["-m", str(model), "--tokens", TIED_TOKENS, "--steps", "2"]
    mine = tmp_path / "mine.h5"
    assert run("dump", "--backend", "cpu", *common, "--out", str(mine)).returncode == 0
    cases = [
        (["--backend", "cuda", *common, "--follow-routing", str(mine), "--out", str(tmp_path / "a.h5")],
         "is the cpu backend's"),
        (["--backend", "cpu", *common, "--follow-routing", str(mine), "--out", str(mine)], "would be overwritten"),
        (["--backend", "cpu", "-m", str(model), "--tokens", "5,6,7", "--steps", "2", "--follow-routing", str(mine),
          "--out", str(tmp_path / "b.h5")], "does not hold this prompt"),
        (["--backend", "cpu", "-m", str(FIXTURES / "tiny-llama-f32.gguf"), "--tokens", TIED_TOKENS, "--steps", "2",
          "--follow-routing", str(mine), "--out", str(tmp_path / "c.h5")], "has no experts"),
        (["--backend", "cpu", *common, "--follow-routing", str(mine), "--replay", str(mine), "--out",
          str(tmp_path / "d.h5")], "give one"),
    ]
    for args, says in cases:
        r = run("dump", *args)
        assert r.returncode == 2 and says in r.stderr, (args, r.stdout + r.stderr)
