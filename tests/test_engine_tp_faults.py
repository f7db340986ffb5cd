"""The tensor-parallel fault catalog (faults/tp_faults.hpp) on the GPU host: `diffrun dump --backend cuda --tp N
--inject tp_...` writes rank dumps, `diffrun compare` of them against the f64 reference finds each fault first at
its checkpoint and step, names its ranks, and a clean run passes. N = 2, and 4 where the host has 4 GPUs.

The engine is fed the reference's tokens (dump --feed), so every run compares the same inputs.

Run through ctest (DIFFRUN_BIN, DIFFRUN_FIXTURE_DIR); exits 77 (skipped) on a host with fewer than 2 GPUs.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

BIN = os.environ.get("DIFFRUN_BIN", "")
FIXTURES = Path(os.environ.get("DIFFRUN_FIXTURE_DIR", ""))
TOKENS = "1,5,9,13,200,31"
STEPS = 2


def gpu_count():
    if not shutil.which("nvidia-smi"):
        return 0
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(1 for line in r.stdout.splitlines() if line.startswith("GPU ")) if r.returncode == 0 else 0


def catalog():
    """(name, first shows at, step, ranks) of each fault, from `diffrun faults`."""
    out = subprocess.run([BIN, "faults"], capture_output=True, text=True, check=True).stdout
    rows, on = [], False
    for line in out.splitlines():
        if line.startswith("tensor-parallel faults"):
            on = True
        elif on and line.startswith("tp_"):
            f = line.split()
            rows.append((f[0], f[1], int(f[2]), f[3]))
    return rows


# Every fault runs on tiny-llama: H 4, Hkv 2 (copied onto two ranks each at N = 4), no q/k norms (a fused RoPE).
MODEL = FIXTURES / "tiny-llama-f32.gguf"


def run(tmp, model, world, inject=None):
    ref = tmp / f"ref-{model.stem}.h5"
    if not ref.exists():
        subprocess.run([BIN, "dump", "--backend", "cpu", "--precision", "f64", "--model", str(model), "--tokens",
                        TOKENS, "--steps", str(STEPS), "--out", str(ref)], check=True, capture_output=True)
    out = tmp / f"tp{world}-{inject or 'clean'}"
    # Fed the reference's tokens (--feed), as an outside engine is: a fault that changes the argmax would otherwise
    # decode other tokens, and compare refuses dumps of different inputs.
    cmd = [BIN, "dump", "--backend", "cuda", "--precision", "f32", "--tp", str(world), "--model", str(model),
           "--tokens", TOKENS, "--steps", str(STEPS), "--feed", str(ref), "--out", str(out)]
    if inject:
        cmd += ["--inject", inject]
    d = subprocess.run(cmd, capture_output=True, text=True)
    assert d.returncode == 0, d.stderr
    report = tmp / f"{out.name}.json"
    c = subprocess.run([BIN, "compare", str(out), str(ref), "--no-color", "--report-json", str(report)],
                       capture_output=True, text=True)
    return c.returncode, json.loads(report.read_text()) if report.exists() else {}, c.stdout + c.stderr


def main():
    import tempfile
    n = gpu_count()
    if n < 2:
        print(f"skipped: the tensor-parallel faults need 2 GPUs; this host has {n}")
        return 77
    if not BIN or not MODEL.exists():
        print("DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR must be set: run through ctest")
        return 1
    failures, checked = [], 0
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for world in [w for w in (2, 4) if w <= n]:
            rc, _, out = run(tmp, MODEL, world)
            if rc != 0:
                failures.append(f"clean TP = {world}: exit {rc}\n{out[-2000:]}")
            for name, where, step, ranks in catalog():
                model = MODEL
                applies = subprocess.run([BIN, "dump", "--backend", "cuda", "--tp", str(world), "--model", str(model),
                                          "--tokens", "1,2", "--steps", "0", "--inject", name, "--out",
                                          str(tmp / "probe")], capture_output=True, text=True)
                shutil.rmtree(tmp / "probe", ignore_errors=True)
                if applies.returncode == 2 and "does not apply" in applies.stderr:
                    print(f"TP = {world} {name}: does not apply to {model.name} ({applies.stderr.strip()[-160:]})")
                    continue
                rc, rep, out = run(tmp, model, world, name)
                first = rep.get("first_divergence") or {}
                got = (first.get("name"), first.get("step"))
                blamed = None
                for cp in rep.get("checkpoints", []):
                    if cp["name"] == first.get("name") and cp["step"] == first.get("step"):
                        blamed = (cp.get("ranks") or {}).get("blamed")
                want = [world - 1] if ranks == "the" else list(range(world))
                ok = rc == 1 and got == (where, step) and blamed == want
                print(f"TP = {world} {name}: exit {rc}, first divergence {got[0]} step {got[1]}, ranks blamed {blamed}"
                      f" (expected {where} step {step}, ranks {want}){'' if ok else '  FAILED'}")
                checked += 1
                if not ok:
                    failures.append(f"{name} at TP = {world}\n{out[-3000:]}")
    for f in failures:
        print("FAILED:", f)
    print(f"{checked} faults checked, {len(failures)} failed")
    return 1 if failures or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
