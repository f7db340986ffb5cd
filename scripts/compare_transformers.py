#!/usr/bin/env python3
"""compare_transformers.py: checks a diffrun reference dump against Hugging Face transformers on the same GGUF.

transformers dequantizes the GGUF weights itself (through the `gguf` package) and runs its own
Llama/Qwen2/Qwen3/Gemma 3 code, so agreement here is agreement with an implementation diffrun did not write.
It runs the dump's token ids (prompt then the fed decode tokens) through one causal forward pass, which
gives, row for row, what each of diffrun's steps computed: step 0 is positions 0..T-1, step i is
position T+i-1. It compares, for every step, l_out-L of every layer, result_norm and result_output
(relative L2 = |a-b|/|b| against transformers, and top-1 of every row) and prints a table.

    diffrun dump --backend cpu --precision f64 --model M.gguf --chat --prompt "..." --steps 4 \\
        --checkpoints 'l_out-*,result_*' --out ref_f64.h5
    python3 scripts/compare_transformers.py --model M.gguf --dump ref_f64.h5 [--write-goldens]

A slice of a large model (scripts/slice_gguf.py FULL.gguf SLICE.gguf --layers N) is compared the same
way; --slice-of FULL_NAME FULL_FINGERPRINT makes its goldens name the full file, of which CI runs the
first N blocks.

Expect about 1e-7, not 1e-14, against a float64 oracle: transformers computes RMSNorm (and its RoPE
tables) in float32 whatever the model's dtype. Its GGUF loader also leaves Qwen3's head_dim at the
config default (128); this script sets it from <arch>.attention.key_length.

This script compares three kinds and writes the CI goldens; to compare every checkpoint of the vocabulary
against transformers, write a transformers dump and let diffrun compare it:
    python3 -m diffrun.adapters.transformers --model M.gguf --reference ref_f64.h5 --out hf.h5
    diffrun compare hf.h5 ref_f64.h5

Exit status: 0 all within tolerance with the same top-1 everywhere, 1 a difference, 2 could not run.
With --write-goldens it writes tests/data/reference/<model stem>.json, which test_reference_goldens
checks in CI without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import h5py
import numpy as np

REPO = Path(__file__).resolve().parent.parent


def read_dump(path: Path):
    """Token ids of every position and, per step, the checkpoints this script compares."""
    steps = {}
    with h5py.File(path, "r") as f:
        if f.attrs.get("format") not in ("diffrun-dump", b"diffrun-dump"):
            raise SystemExit(f"{path}: not a diffrun dump")
        attrs = {k: f.attrs[k] for k in f.attrs}
        names = sorted(k for k in f.keys() if k.startswith("step_"))
        ids = []
        for name in names:
            g = f[name]
            step = int(name.split("_")[1])
            if "tokens" not in g:
                raise SystemExit(f"{path}: {name} has no tokens dataset")
            ids.extend(int(t) for t in g["tokens"][()])
            steps[step] = {k: g[k][()] for k in g.keys() if k.startswith("l_out-") or k.startswith("result_")}
    return attrs, ids, steps


def step_rows(steps: dict, n_prompt: int) -> dict:
    """Positions (rows of the one-pass run) that each step computed."""
    rows = {}
    for step in steps:
        rows[step] = list(range(n_prompt)) if step == 0 else [n_prompt + step - 1]
    return rows


def gguf_head_dim(model: Path) -> int | None:
    """<arch>.attention.key_length from the GGUF (read with the gguf package), or None when absent."""
    from gguf import GGUFReader

    reader = GGUFReader(str(model))
    arch = reader.fields["general.architecture"]
    arch_name = bytes(arch.parts[arch.data[0]]).decode()
    field = reader.fields.get(f"{arch_name}.attention.key_length")
    return int(field.parts[field.data[0]][0]) if field is not None else None


def run_transformers(model: Path, ids: list[int], dtype: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    import transformers

    torch_dtype = {"float64": torch.float64, "float32": torch.float32}[dtype]
    # transformers 4.56 renamed torch_dtype to dtype; older versions would take `dtype` as a config field.
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    config = transformers.AutoConfig.from_pretrained(str(model.parent), gguf_file=model.name)
    head_dim = gguf_head_dim(model)
    if head_dim and getattr(config, "head_dim", head_dim) != head_dim:
        # transformers' GGUF loader does not map <arch>.attention.key_length: Qwen3Config keeps its
        # default head_dim (128) and a model with another head width would not run.
        print(f"note: transformers set head_dim {config.head_dim}; the GGUF says {head_dim}: using {head_dim}")
        config.head_dim = head_dim
    hf = AutoModelForCausalLM.from_pretrained(
        str(model.parent), gguf_file=model.name, config=config, attn_implementation="eager", **{dtype_kw: torch_dtype}
    )
    hf.to(device).eval()
    if next(hf.parameters()).dtype != torch_dtype:
        raise SystemExit(f"transformers loaded {next(hf.parameters()).dtype}, not {torch_dtype}")
    layers = hf.model.layers
    captured: dict[str, np.ndarray] = {}

    def keep(name):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            captured[name] = out[0].detach().to("cpu", torch.float64).numpy()

        return hook

    handles = [layer.register_forward_hook(keep(f"l_out-{i}")) for i, layer in enumerate(layers)]
    handles.append(hf.model.norm.register_forward_hook(keep("result_norm")))
    with torch.no_grad():
        out = hf(torch.tensor([ids], device=device), use_cache=False)
    for h in handles:
        h.remove()
    captured["result_output"] = out.logits[0].detach().to("cpu", torch.float64).numpy()
    versions = f"transformers {transformers.__version__}, torch {torch.__version__}, {dtype}, {device}"
    return captured, versions


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    nb = float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) / (nb if nb > 0 else 1.0)


def compare(steps: dict, rows: dict, hf: dict, n_vocab: int, tol: float):
    """Per checkpoint: worst rel L2 over steps and where; per step: top-1 agreement of every row."""
    worst: dict[str, tuple[float, int]] = {}
    top1 = {}
    for step, cps in sorted(steps.items()):
        r = rows[step]
        for name, ours in cps.items():
            if name not in hf:
                continue
            theirs = hf[name][r]
            if name == "result_output":
                theirs = theirs[:, :n_vocab]
                top1[step] = (int((ours.argmax(-1) == theirs.argmax(-1)).sum()), len(r))
            if ours.shape != theirs.shape:
                raise SystemExit(f"step {step} {name}: dump shape {ours.shape}, transformers {theirs.shape}")
            e = rel_l2(ours.astype(np.float64), theirs)
            if name not in worst or e > worst[name][0]:
                worst[name] = (e, step)
    order = sorted(worst, key=lambda n: (n.startswith("result"), int(n.split("-")[1]) if "-" in n else 0, n))
    ok = True
    print(f"{'checkpoint':<16} {'worst rel L2':>13} {'step':>5}  {'tol':>7}")
    for name in order:
        e, step = worst[name]
        passed = e < tol
        ok &= passed
        print(f"{name:<16} {e:13.3e} {step:5d}  {tol:7.0e} {'ok' if passed else 'FAIL'}")
    print()
    for step, (same, n) in sorted(top1.items()):
        ok &= same == n
        print(f"step {step}: top-1 agrees on {same}/{n} rows {'ok' if same == n else 'FAIL'}")
    if not top1:
        print("no result_output in the dump: top-1 not compared")
        ok = False
    return ok


def goldens(model: Path, attrs: dict, ids: list[int], n_prompt: int, hf: dict, n_vocab: int, versions: str,
            slice_of: tuple[str, str] | None):
    """A few positions' top-5 logits, per-layer l_out norms and first values, result_norm values."""
    n = len(ids)
    positions = sorted({0, n_prompt // 2, n_prompt - 1, n - 1})
    n_layer = sum(1 for k in hf if k.startswith("l_out-"))
    entries = []
    for p in positions:
        logits = hf["result_output"][p, :n_vocab]
        top = np.argsort(-logits, kind="stable")[:5]
        entries.append(
            {
                "position": p,
                "top5_ids": [int(i) for i in top],
                "top5_logits": [float(logits[i]) for i in top],
                "l_out_norm": [float(np.linalg.norm(hf[f"l_out-{i}"][p])) for i in range(n_layer)],
                "l_out_first": [[float(v) for v in hf[f"l_out-{i}"][p, :4]] for i in range(n_layer)],
                "result_norm_norm": float(np.linalg.norm(hf["result_norm"][p])),
                "result_norm_first": [float(v) for v in hf["result_norm"][p, :8]],
            }
        )
    fp = attrs.get("model_fingerprint", "")
    golden = {
        "model": model.name,
        "model_fingerprint": fp.decode() if isinstance(fp, bytes) else str(fp),
        "source": versions,
        "token_ids": ids,
        "n_prompt": n_prompt,
        "n_layer": n_layer,
        "positions": entries,
    }
    if slice_of:
        # The model is the first n_layer blocks of a larger file (scripts/slice_gguf.py): CI runs those
        # blocks of the full file, which it has, and checks the full file's fingerprint.
        golden["slice_of"] = {"model": slice_of[0], "model_fingerprint": slice_of[1]}
    return golden


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path, help="the GGUF the dump was made from")
    ap.add_argument("--dump", required=True, type=Path, help="diffrun's f64 reference dump (HDF5)")
    ap.add_argument("--tokens", help="token ids (1,2,3) that must match the dump's; default: read from the dump")
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    ap.add_argument("--tol", type=float, default=1e-3, help="relative L2 bound (default 1e-3)")
    ap.add_argument("--write-goldens", nargs="?", const="", default=None, metavar="PATH",
                    help="write goldens (default tests/data/reference/<model stem>.json)")
    ap.add_argument("--slice-of", nargs=2, metavar=("FULL_NAME", "FULL_FINGERPRINT"),
                    help="--model is a slice (scripts/slice_gguf.py) of this file: the goldens name the full file")
    args = ap.parse_args()

    if not args.model.is_file():
        print(f"compare_transformers: no model at {args.model}", file=sys.stderr)
        return 2
    attrs, ids, steps = read_dump(args.dump)
    n_prompt = len(np.asarray(attrs["token_ids"]).reshape(-1)) if "token_ids" in attrs else len(ids) - len(steps) + 1
    if args.tokens:
        given = [int(t) for t in args.tokens.split(",")]
        if given != ids:
            print(f"compare_transformers: --tokens {given} differ from the dump's {ids}", file=sys.stderr)
            return 2
    n_vocab = int(attrs["n_vocab"])
    precision = attrs.get("precision", b"")
    precision = precision.decode() if isinstance(precision, bytes) else str(precision)
    if precision != "f64":
        print(f"compare_transformers: note: the dump's precision is {precision}, not f64", file=sys.stderr)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"{args.model.name}: {len(ids)} positions ({n_prompt} prompt + {len(steps) - 1} decode steps)")
    hf, versions = run_transformers(args.model, ids, args.dtype, device)
    print(f"oracle: {versions}\n")
    ok = compare(steps, step_rows(steps, n_prompt), hf, n_vocab, args.tol)

    if args.write_goldens is not None:
        default = REPO / "tests/data/reference" / f"{args.model.stem}.json"
        out = Path(args.write_goldens) if args.write_goldens else default
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(goldens(args.model, attrs, ids, n_prompt, hf, n_vocab, versions, args.slice_of), indent=1) + "\n")
        print(f"\nwrote {os.path.relpath(out)}")
    print("\nPASS" if ok else "\nFAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
