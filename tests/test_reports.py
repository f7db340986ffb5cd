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

    # Every other failing checkpoint of the JSON report is a skipped consequence; nothing is lost.
    json_failed = [c for c in report["checkpoints"] if c["status"] in ("fail", "shape_mismatch")]
    assert len(json_failed) > 1000, len(json_failed)
    consequences = [c for c in skipped if c.result[0].message == "consequence of Qrope-0 (step 0)"]
    assert len(consequences) == len(json_failed) - 1
    assert passed + len(skipped) + 1 == len(report["checkpoints"])


def check_width(text):
    long = [line for line in text.splitlines() if len(line) > 100]
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


def test_clean_terminal_report_fits(tmp_path):
    r = run("--prompt", PROMPT, "--chat", "--engine", "cpu", "--steps", "1", "--no-color", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    check_width(r.stdout)
    assert "RESULT: PASS" in r.stdout and "to pass" not in r.stdout


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
