#!/usr/bin/env python3
"""Times the top-level job (`diffrun --prompt ...`) N times: each run's wall time, user and system CPU, peak RSS, and the median wall.

usage: bench/bench_main_job.py [--runs N] [--bin PATH] [-- diffrun options...]
Without diffrun options: the README's main job (the default model, the chat prompt, 8 decode steps).
Each run writes into a fresh temporary --out (removed afterwards) unless the options give one. The
job's exit code (0 pass, 1 divergence) is printed; any other stops the benchmark (exit 2).
"""
import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--bin", default=os.path.join(HERE, "..", "build", "cli", "diffrun"))
    ap.add_argument("job", nargs=argparse.REMAINDER, help="diffrun options (after --)")
    a = ap.parse_args()
    job = [x for x in a.job if x != "--"] or ["--prompt", "What is the capital of France?", "--chat"]
    if not os.access(a.bin, os.X_OK):
        print(f"bench_main_job: {a.bin} is not an executable (build diffrun first, or --bin PATH)", file=sys.stderr)
        return 2
    has_out = any(x in ("--out", "-o") or x.startswith("--out=") for x in job)
    print(f"bench_main_job: {a.runs} runs of: diffrun {' '.join(job)}")
    print(f"bench_main_job: {len(os.sched_getaffinity(0))} cores available, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    walls = []
    for i in range(1, a.runs + 1):
        tmp = tempfile.mkdtemp(prefix="bench_main_job.")
        try:
            cmd = [a.bin, *job, "--no-color"] + ([] if has_out else ["--out", os.path.join(tmp, "out")])
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if r.returncode not in (0, 1):
            print(f"bench_main_job: run {i} exited {r.returncode}:\n{r.stderr[-2000:]}", file=sys.stderr)
            return 2
        walls.append(wall)
        print(f"run {i}: {wall:6.2f} s wall  {after.ru_utime - before.ru_utime:6.2f} s user  "
              f"{after.ru_stime - before.ru_stime:6.2f} s sys  {after.ru_maxrss / 1024:7.0f} MB peak RSS (max so far)  "
              f"exit {r.returncode}")
    print(f"median wall: {statistics.median(walls):.2f} s over {a.runs} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
