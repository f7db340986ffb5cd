# The reports of a default run on SmolLM2 with an injected fault: JUnit (checked with junitparser), JSON, terminal.
import json
import os
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
