#!/usr/bin/env python3
"""Writes diffrun's deterministic random-weight GGUF fixtures (see fixtures/README.md).

    scripts/gen_fixtures.py --out build/fixtures                  # every tiny fixture (seconds)
    scripts/gen_fixtures.py --out DIR --shape qwen2.5-0.5b        # full-size shape, F16
    scripts/gen_fixtures.py --out DIR --shape tinyllama-1.1b      # full-size shape, Q5_K_M mix
    scripts/gen_fixtures.py --out DIR --shape smollm2-135m        # full-size shape, Q4_1 (Q8_0 embedding)

Needs only numpy and the gguf package. The tiny set is skipped when a stamp in DIR says it was
written by the same generator sources, vocabularies and seed (--force rewrites it).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixturegen import models  # noqa: E402
from fixturegen.vocab import VOCAB_DIR  # noqa: E402

STAMP = ".gen_fixtures.stamp"


def tiny_files() -> list[tuple[models.Shape, str, str]]:
    return [(s, fmt, f"{s.name}-{fmt}.gguf") for s in models.TINY.values() for fmt in models.TINY_FORMATS]


def gguf_version() -> str:
    try:
        return importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:  # a copied package without its dist-info
        return "unknown"


def sources_digest(seed: int) -> str:
    h = hashlib.sha256(f"seed={seed} gguf={gguf_version()}".encode())
    here = Path(__file__).resolve()
    for p in [here, *sorted((here.parent / "fixturegen").glob("*.py")), *sorted(VOCAB_DIR.glob("*.tokenizer.json"))]:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--shape", choices=sorted(models.FULL), help="write one full-size shape instead of the tiny set")
    ap.add_argument("--force", action="store_true", help="rewrite even when the stamp says up to date")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    if args.shape:
        shape = models.FULL[args.shape]
        path = args.out / f"{shape.name}-{models.FULL_FORMAT[shape.name]}.gguf"
        models.write_model(shape, models.FULL_FORMAT[shape.name], path, args.seed)
        print(f"gen_fixtures: wrote {path} ({path.stat().st_size / 2**20:.1f} MiB) in {time.monotonic() - t0:.1f} s")
        return 0

    files = tiny_files()
    stamp = args.out / STAMP
    digest = sources_digest(args.seed)
    if (not args.force and stamp.exists() and stamp.read_text().strip() == digest
            and all((args.out / f).exists() for _, _, f in files)):
        print(f"gen_fixtures: {len(files)} tiny fixtures in {args.out} are up to date")
        return 0
    stamp.unlink(missing_ok=True)
    total = 0
    for shape, fmt, fname in files:
        models.write_model(shape, fmt, args.out / fname, args.seed)
        total += (args.out / fname).stat().st_size
    stamp.write_text(digest + "\n")
    print(f"gen_fixtures: wrote {len(files)} tiny fixtures ({total / 2**20:.1f} MiB) to {args.out} "
          f"in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
