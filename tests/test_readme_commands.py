# Runs every command of README.md's "Using it" block as shown, on a tiny fixture standing in for the default model.
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(os.environ.get("DIFFRUN_SOURCE_DIR", Path(__file__).resolve().parents[1]))
FIXTURES = Path(os.environ.get("DIFFRUN_FIXTURE_DIR", SOURCE / "build" / "fixtures"))
DIFFRUN = os.environ.get("DIFFRUN_BIN", str(SOURCE / "build" / "cli" / "diffrun"))
MODEL = FIXTURES / "tiny-qwen2-f32.gguf"  # rope_theta 1e6, so rope_theta_10000 shows


def readme_commands():
    """The commands of every sh block of the "Using it" section, in order."""
    text = (SOURCE / "README.md").read_text()
    section = text[text.index("## Using it"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        lines += [re.sub(r"\s{2,}#.*$", "", line).strip() for line in block.splitlines()]
    return [line for line in lines if line]


def test_readme_lists_every_subcommand():
    out = subprocess.run([DIFFRUN, "--help"], capture_output=True, text=True, check=True).stdout
    subcommands = re.findall(r"^  (\w+)\s{2,}", out.split("Subcommands:", 1)[1].split("Examples:")[0], re.M)
    assert len(subcommands) >= 10, out
    used = {shlex.split(c)[1] for c in readme_commands() if len(shlex.split(c)) > 1}
    assert set(subcommands) <= used, set(subcommands) - used
    assert "Exit codes:" in out and "Examples:" in out


def test_readme_commands_run_as_shown(tmp_path):
    if not MODEL.exists():
        pytest.skip(f"fixture missing: {MODEL} (run the fixtures_generate test)")
    models = tmp_path / "models"
    models.mkdir()
    # The default model's file name, so commands without --model run on the fixture.
    (models / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(MODEL)
    # The checkout's Python package (the plots), and its diffrun for the plots' comparison.
    env = dict(os.environ, DIFFRUN_MODELS=str(models), DIFFRUN_BIN=DIFFRUN, MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join(filter(None, [str(SOURCE / "python"), os.environ.get("PYTHONPATH")])))
    commands = readme_commands()
    assert all(c.startswith(("build/cli/diffrun", "python3 -m diffrun.")) for c in commands), commands
    assert any(c.startswith("python3 -m diffrun.plot") for c in commands), commands
    for command in commands:
        command = command.replace("build/cli/diffrun", shlex.quote(DIFFRUN), 1).replace("MODEL.gguf", shlex.quote(str(MODEL)))
        command = command.replace("python3 -m", shlex.quote(sys.executable) + " -m", 1)
        r = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        args = shlex.split(command)[1:]
        comparing = not args or args[0].startswith("--") or args[0] == "compare"
        allowed = (0, 1) if comparing else (0,)
        assert r.returncode in allowed, f"{command}\nrc {r.returncode}\n{r.stdout}\n{r.stderr}"
        if "--inject rope_theta_10000" in command:
            assert r.returncode == 1 and "FIRST DIVERGENCE  Qrope-0  (step 0, layer 0)" in r.stdout, r.stdout
        if "diffrun.plot" in command:  # diffrun-out holds the fault run: its first divergence is drawn
            assert "heatmap_Qrope-0_step0.png" in r.stdout, r.stdout + r.stderr
