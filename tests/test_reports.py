# The reports of a default run on SmolLM2 with an injected fault: JUnit (checked with junitparser), JSON, terminal.
import json
import os
import re
import subprocess

import junitparser
import pytest

DIFFRUN = os.environ.get("DIFFRUN_BIN", "build/cli/diffrun")
PROMPT = "What is the capital of France?"


def run(*args, cwd=None):
    return subprocess.run([DIFFRUN, *args], capture_output=True, text=True, cwd=cwd)


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("fault")
    r = run("--prompt", PROMPT, "--chat", "--engine", "cpu", "--inject", "rope_theta_10000", "--no-color",
            "--out", str(d / "out"), "--report-junit", str(d / "r.xml"), "--report-json", str(d / "r.json"))
    assert r.returncode == 1, r.stdout + r.stderr
    return d, r.stdout


def test_junit_has_one_failure_naming_the_first_divergence(fault_run):
    d, _ = fault_run
    xml = d / "r.xml"
    assert xml.stat().st_size <= 1_000_000, xml.stat().st_size
    report = json.loads((d / "r.json").read_text())
    first = report["first_divergence"]
    assert (first["name"], first["step"]) == ("Qrope-0", 0)

    failed, skipped, passed = [], [], 0
    suites = junitparser.JUnitXml.fromfile(str(xml))
    for suite in suites:
        if suite.name == "coverage":  # the top-level job requires 100%: one more case, passing
            assert [type(r).__name__ for case in suite for r in case.result] == [], suite
            continue
        for case in suite:
            kinds = {type(r).__name__ for r in case.result}
            if "Failure" in kinds:
                failed.append(case)
            elif "Skipped" in kinds:
                skipped.append(case)
            else:
                passed += 1
    assert [(c.classname, c.name) for c in failed] == [("step_0000", "Qrope-0")]
    message = failed[0].result[0].message
    assert message.startswith("first divergence Qrope-0 (step 0, layer 0): rel_l2 "), message
    assert "; worst T=" in message and "; pattern token rows 0 exact" in message, message
    assert "verdict local (rule jump)" in failed[0].result[0].text

    # Every other failing checkpoint of the JSON report is a consequence: one skipped case per step
    # counts them and lists their kinds and layers; nothing is lost.
    json_failed = [c for c in report["checkpoints"] if c["status"] in ("fail", "shape_mismatch")]
    assert len(json_failed) > 1000, len(json_failed)
    assert [c.name for c in skipped] == ["consequences of Qrope-0 (step 0)"] * 9
    listed = 0
    for case in skipped:
        step = int(case.classname.split("_")[1])
        message = case.result[0].message
        n = int(message.split()[0])
        assert message == f"{n} checkpoints of this step fail downstream of Qrope-0 (step 0)", message
        expected = [c for c in json_failed if c["step"] == step and (c["name"], step) != ("Qrope-0", 0)]
        assert n == len(expected)
        names = set()
        for part in case.result[0].text.strip().split(", "):
            kind, _, layers = part.partition(" ")
            for r in filter(None, layers.split(",")):
                lo, _, hi = r.partition("-")
                names |= {f"{kind}-{layer}" for layer in range(int(lo), int(hi or lo) + 1)}
            if not layers:
                names.add(kind)
        assert names == {c["name"] for c in expected}
        listed += n
    assert listed == len(json_failed) - 1
    assert passed + listed + 1 == len(report["checkpoints"])
    assert suites.tests == passed + len(skipped) + 1 + 1 and suites.failures == 1  # + the coverage case
    assert xml.stat().st_size < 100_000, xml.stat().st_size  # 618 KB with one skipped case per checkpoint


# An absolute path (a dump, the model, the --out directory) is the user's, as long as TMPDIR or HOME
# make it, and cannot be wrapped: each counts as the 24 columns of "/tmp/pytest-0/fault0/out".
# The rest of every line, the report's own text, must fit in 100 columns.
ABSOLUTE_PATH = re.compile(r"(?<![\w./-])/[^\s()\"',]+")


def check_width(text):
    long = [line for line in text.splitlines() if len(ABSOLUTE_PATH.sub("x" * 24, line)) > 100]
    assert not long, "\n".join(long)


def test_terminal_report_with_a_fault_fits_and_leads_with_the_divergence(fault_run):
    _, out = fault_run
    check_width(out)
    lines = out.splitlines()
    assert lines[0] == "diffrun"  # the top-level job, not "diffrun compare"
    first = lines.index("FIRST DIVERGENCE  Qrope-0  (step 0, layer 0)")
    pattern = next(i for i, line in enumerate(lines) if line.startswith("  pattern "))
    table = next(i for i, line in enumerate(lines) if line.startswith("Relative L2 error by layer"))
    assert first < pattern < table, out
    # A local verdict: no calibration note, no "to pass" (they invite loosening the bound).
    assert "verdict   LOCAL" in out and "to pass" not in out and "measured up to" not in out, out
    # The kinds failing at every layer downstream are one line, not one row each.
    rows = [line.split()[0] for line in lines[table + 3:] if line.startswith("  ") and not line.startswith("   ")]
    assert "Qrope" in rows and "ffn_up" not in rows, rows
    collapsed = out[out.index("more kinds fail at every layer from layer"):].split("\n  outside layers")[0]
    assert "ffn_up" in collapsed and "Qrope" not in collapsed, collapsed
    # Token agreement does not grow one line per step (9 steps here).
    tokens = next(i for i, line in enumerate(lines) if line.startswith("Tokens "))
    assert "8/9 steps agree" in lines[tokens], lines[tokens]
    assert len([line for line in lines[tokens:] if line.startswith("  step ")]) == 1, out


def test_full_explain_and_summary(fault_run):
    d, _ = fault_run
    out = d / "out"
    r = run("compare", str(out / "engine.h5"), str(out / "reference.h5"), "--no-color", "--full", "--explain")
    assert r.returncode == 1, r.stderr
    check_width(r.stdout)
    assert r.stdout.splitlines()[0] == "diffrun compare"
    assert "to pass   atol >= " in r.stdout and "measured up to" in r.stdout, r.stdout
    assert "\n  ffn_up " in r.stdout and "more kinds fail" not in r.stdout, r.stdout
    # Token ids decoded with --model (the default model here).
    assert '"The"' not in r.stdout
    model = subprocess.run([DIFFRUN, "--help"], capture_output=True, text=True).stdout
    path = re.search(r"-m,--model TEXT=(\S+)", model).group(1)
    r = run("compare", str(out / "engine.h5"), str(out / "reference.h5"), "--no-color", "--model", path)
    assert 'reference 504 "The"' in r.stdout, r.stdout
    r = run("compare", str(out / "engine.h5"), str(out / "reference.h5"), "--summary")
    assert r.returncode == 1 and r.stdout.count("\n") == 1, r.stdout
    assert r.stdout.startswith("DIVERGED at Qrope-0 (step 0, layer 0) rel_l2 0.5"), r.stdout


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("clean")
    r = run("--prompt", PROMPT, "--chat", "--engine", "cpu", "--steps", "1", "--no-color", "--out", str(d))
    assert r.returncode == 0, r.stdout + r.stderr
    return d, r.stdout


def test_clean_terminal_report_fits(clean_run):
    _, out = clean_run
    check_width(out)
    assert "RESULT: PASS" in out and "to pass" not in out


def test_isolate_report_fits_and_compare_of_the_run_directory_repeats_it(tmp_path):
    out = tmp_path / "out"
    r = run("--prompt", PROMPT, "--chat", "--engine", "cpu", "--steps", "1", "--inject", "rope_theta_10000",
            "--isolate", "--no-color", "--out", str(out))
    assert r.returncode == 1, r.stdout + r.stderr
    check_width(r.stdout)
    assert "verdict   LOCAL (rule isolation)" in r.stdout, r.stdout
    assert "  kind           local  layer 0 layer 29" in r.stdout, r.stdout
    # compare DIR: the run's own report again (its engine-isolated.h5 included), from its --out directory.
    model = re.search(r"-m,--model TEXT=(\S+)", run("--help").stdout).group(1)
    again = run("compare", str(out), "--no-color", "--require-coverage", "100", "--model", model)
    assert again.returncode == 1, again.stderr
    assert again.stdout.split("\n", 1)[1] == r.stdout.split("\n", 1)[1]  # all but the title line
    check_width(run("compare", str(out), "--no-color", "--full", "--explain").stdout)


def test_two_pair_layout_fits(fault_run, clean_run, tmp_path):
    # The GPU run's --out layout (logic/ and precision/), here from two CPU runs.
    for sub, src in (("logic", fault_run[0] / "out"), ("precision", clean_run[0])):
        (tmp_path / sub).mkdir()
        for f in ("engine.h5", "reference.h5"):
            (tmp_path / sub / f).symlink_to(src / f)
    xml = tmp_path / "pairs.xml"
    for extra in ([], ["--full"], ["--explain"]):
        r = run("compare", str(tmp_path), "--no-color", "--report-junit", str(xml), *extra)
        assert r.returncode == 1, r.stderr
        check_width(r.stdout)
    lines = r.stdout.splitlines()
    assert "=== logic: cpu/f32 engine vs cpu/f64 reference ===" in lines, r.stdout
    assert "=== precision: cpu/f32 engine vs cpu/f64 reference ===" in lines, r.stdout
    assert lines[-2:] == ["  logic: cpu/f32 engine vs cpu/f64 reference: DIVERGED",
                          "  precision: cpu/f32 engine vs cpu/f64 reference: PASS"], r.stdout
    suites = junitparser.JUnitXml.fromfile(str(xml))
    failed = [(suite.name, case.name) for suite in suites for case in suite
              if any(type(x).__name__ == "Failure" for x in case.result)]
    assert failed == [("logic: cpu/f32 engine vs cpu/f64 reference: step_0000", "Qrope-0")], failed
    cases = sum(1 for suite in suites for _ in suite)
    assert suites.tests == cases and suites.failures == 1, (suites.tests, cases)
    summary = run("compare", str(tmp_path), "--summary")
    assert summary.returncode == 1
    assert [line.split()[:2] for line in summary.stdout.splitlines()] == [["logic:", "DIVERGED"], ["precision:", "PASS"]]


def test_compare_filters(fault_run, tmp_path):
    d, _ = fault_run
    out = tmp_path / "r.json"
    r = run("compare", str(d / "out"), "--steps", "1-2,5", "--checkpoints", "l_out-*,result_*", "--no-color",
            "--report-json", str(out))
    assert r.returncode == 1, r.stderr
    report = json.loads(out.read_text())
    cps = report["checkpoints"]
    assert {c["step"] for c in cps} == {1, 2, 5}
    assert all(re.fullmatch(r"l_out-\d+|result_norm|result_output", c["name"]) for c in cps), cps
    assert len(cps) == 3 * 32 and report["coverage"]["compared"] == 3 * 32
    assert (report["first_divergence"]["name"], report["first_divergence"]["step"]) == ("l_out-0", 1)
    assert "Tokens (reference's next token vs engine argmax): 3/3 steps agree" in r.stdout, r.stdout
    for args, message in ((["--steps", "2-1"], "--steps '2-1': the range '2-1' is empty"),
                          (["--steps", "x"], "--steps 'x': 'x' is not a step"),
                          (["--steps", "40"], "hold steps 0-8"),
                          (["--checkpoints", "nothing*"], "--checkpoints 'nothing*' matches no checkpoint")):
        bad = run("compare", str(d / "out"), *args)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
    bad = run("compare", str(tmp_path))
    assert bad.returncode == 2 and "a directory without engine.h5 and reference.h5" in bad.stderr, bad.stderr


def test_show_one_dump_with_a_slice_matches_h5py(fault_run):
    import h5py
    import numpy as np

    d, _ = fault_run
    eng = d / "out" / "engine.h5"
    r = run("show", str(eng), "Qrope-0", "--slice", "T=3,H=1", "--cols", "64")
    assert r.returncode == 0, r.stderr
    with h5py.File(eng) as f:
        q = f["step_0000/Qrope-0"][3, 1, :].astype(np.float64)
    assert "64 values in the slice: 64 finite" in r.stdout, r.stdout
    assert re.search(rf"min  {q.min():.7g}\s+at \[3, 1, {q.argmin()}\]", r.stdout), r.stdout
    row = next(line for line in r.stdout.splitlines() if line.startswith("  [3, 1]")).split()[2:]
    assert [float(x) for x in row] == pytest.approx(q, rel=1e-4)
    r = run("show", str(eng), "Qrope-0", "--slice", "Dh=5", "--rows", "2")
    assert "first 2 of 333 rows (T,H) x column Dh=5" in r.stdout, r.stdout


def test_show_pair_matches_h5py(fault_run):
    import h5py
    import numpy as np

    d, _ = fault_run
    eng, ref = d / "out" / "engine.h5", d / "out" / "reference.h5"
    r = run("show", str(eng), str(ref), "Qrope-0", "--top", "1")
    assert r.returncode == 0, r.stderr
    with h5py.File(eng) as fa, h5py.File(ref) as fb:
        a = fa["step_0000/Qrope-0"][()].astype(np.float64)
        b = fb["step_0000/Qrope-0"][()].astype(np.float64)
    diff = np.abs(a - b)
    t, h, c = np.unravel_index(np.argmax(diff), diff.shape)
    worst = r.stdout.split("worst 1 (T,H,Dh)\n")[1].splitlines()[1].split()
    assert worst[:3] == [f"T={t},", f"H={h},", f"Dh={c}"], r.stdout
    assert float(worst[5]) == pytest.approx(diff.max(), rel=1e-3)
    rel = float(re.search(r"rel_l2 (\S+)", r.stdout).group(1))
    assert rel == pytest.approx(np.linalg.norm(a - b) / np.linalg.norm(b), rel=1e-3)
    r = run("show", str(eng), str(ref), "Qrope-0", "--slice", "X=1")
    assert r.returncode == 2 and "--slice 'X=1'" in r.stderr, r.stderr


def test_help_fits_in_100_columns():
    top = subprocess.run([DIFFRUN, "--help"], capture_output=True, text=True)
    assert top.returncode == 0, top.stderr
    check_width(top.stdout)
    subcommands = re.findall(r"^  ([a-z]+) {2,}\S", top.stdout.split("Subcommands:")[1], re.M)
    assert {"compare", "dump", "validate"} <= set(subcommands), top.stdout
    for sub in subcommands:
        r = subprocess.run([DIFFRUN, sub, "--help"], capture_output=True, text=True)
        assert r.returncode == 0, (sub, r.stderr)
        check_width(r.stdout)
        assert r.stdout.count("\n") > 3, (sub, r.stdout)
