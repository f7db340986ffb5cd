#!/usr/bin/env python3
"""tp_numpy_engine.py: numpy_engine's llama forward pass run as N tensor-parallel ranks, one rank dump each.

Each rank is a thread running examples/numpy_engine's Engine on its Megatron slice of the weights (as vLLM and SGLang
shard a llama layer; docs/dump-format.md, "Shards"), with its own KV cache and its own dump, and the ranks meet in
an all-reduce after each row-parallel projection:

    q, k, v, gate, up   column parallel: rank r holds query heads r·H/N.., KV heads r·Hkv/N.. (where Hkv < N,
                        a copy of KV head r·Hkv/N, floored), FFN channels r·F/N..
    attn_output, down   row parallel: rank r's columns of the weight give it a partial sum, which the all-reduce
                        adds up (in rank order, float32) before the residual
    lm head             vocabulary parallel: rank r's logits are its vocabulary slice (ceil(V/N) ids each)
    embedding, norms    replicated

Every checkpoint is recorded as the rank holds it: split with its shard_offset, partial, or replicated.

    diffrun dump --backend cpu --precision f64 --model M.gguf --prompt "Hello" --steps 4 --out ref.h5
    python3 examples/tp_numpy_engine/tp_numpy_engine.py --model M.gguf --reference ref.h5 --world-size 2 --out tp
    diffrun compare tp ref.h5

--bug NAME seeds one shard bug on rank --bug-rank (default 1), to see how diffrun names the rank:
    wq_wrong_shard          it loads the Wq rows of the next rank's heads           -> Qcur-0, step 0
    attn_allreduce_skipped  it adds its own partial attn_out to the residual
                            instead of the all-reduced sum                          -> ffn_inp-0, step 0
    rope_position_offset    at decode steps it rotates q and k at the cache length
                            after the step's write (S) instead of S - 1             -> Qrope-0, step 1
    kv_stale_row            at decode steps its KV cache write is lost: attention
                            reads the stale (zero) row at the new position          -> cache_k-0, step 1
Exit status: 0 written, 2 bad input.
"""

import argparse
import contextlib
import functools
import os
import sys
import threading

import numpy as np

import diffrun

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "numpy_engine"))
import numpy_engine  # noqa: E402

BUGS = ("wq_wrong_shard", "attn_allreduce_skipped", "rope_position_offset", "kv_stale_row")

# The Megatron layout: the letter each column-parallel checkpoint is split along (the lm head's logits along the
# vocabulary); the row-parallel outputs, recorded before their all-reduce; everything else is replicated.
SPLIT = {"Qcur": "H", "Qrope": "H", "kq_soft_max": "H", "kqv_out": "H",
         "Kcur": "Hkv", "Vcur": "Hkv", "Krope": "Hkv", "cache_k": "Hkv", "cache_v": "Hkv",
         "ffn_gate": "F", "ffn_up": "F", "ffn_swiglu": "F", "result_output": "V"}
PARTIAL = {"attn_out", "ffn_out"}

# How a layer's weights are cut: (numpy axis, the letter whose slice the rank takes); heads are Dh rows (columns) each.
WEIGHT_SPLIT = {"attn_q": (0, "H"), "attn_k": (0, "Hkv"), "attn_v": (0, "Hkv"), "attn_output": (1, "H"),
                "ffn_gate": (0, "F"), "ffn_up": (0, "F"), "ffn_down": (1, "F")}


def share(size, world, rank):
    """Rank's [start, stop) of `size` heads or channels: an equal share, or where size < world (KV heads), the one
    item r·size/world (floored) it holds a copy of."""
    if size < world:
        i = rank * size // world
        return i, i + 1
    n = size // world
    return rank * n, (rank + 1) * n


def vocab_share(n_vocab, world, rank):
    """Rank's [start, stop) of the vocabulary: ceil(V/N) ids each, the last rank the rest."""
    n = -(-n_vocab // world)
    return min(rank * n, n_vocab), min((rank + 1) * n, n_vocab)


def layout_problem(meta, world):
    """Why the model cannot be split over `world` ranks the Megatron way, or None."""
    H, Hkv, F, V = (int(meta[k]) for k in ("n_head", "n_head_kv", "n_ff", "n_vocab"))
    if world < 1:
        return f"world size {world} is not a positive number of ranks"
    if H % world or F % world:
        return f"n_head {H} and n_ff {F} must both be multiples of the world size {world}"
    if Hkv % world and world % Hkv:
        return f"n_head_kv {Hkv} must divide or be a multiple of the world size {world}"
    if vocab_share(V, world, world - 1)[0] >= V:
        return f"n_vocab {V} leaves rank {world - 1} no vocabulary slice"
    return None


class AllReduce:
    """The ranks' sum all-reduce: each rank hands in its partial and gets back the same sum, added in rank order."""

    def __init__(self, world):
        self._parts = [None] * world
        self._barrier = threading.Barrier(world)

    def __call__(self, rank, partial):
        self._parts[rank] = partial
        self._barrier.wait()
        total = functools.reduce(np.add, self._parts)
        self._barrier.wait()  # every rank has read the parts before any hands in its next one
        return total

    def abort(self):
        """Wakes the ranks waiting in it with threading.BrokenBarrierError (a rank failed)."""
        self._barrier.abort()


class Rank(numpy_engine.Engine):
    """One rank: numpy_engine's forward pass on the rank's slices of the weights, with its own KV cache."""

    def __init__(self, weights, meta, rank, world, all_reduce, bug=None):
        H, Hkv, self.head_dim = int(meta["n_head"]), int(meta["n_head_kv"]), int(meta["head_dim"])
        self.rank, self.all_reduce, self.shard_bug = rank, all_reduce, bug
        self.slices = {"H": share(H, world, rank), "Hkv": share(Hkv, world, rank),
                       "F": share(int(meta["n_ff"]), world, rank), "V": vocab_share(int(meta["n_vocab"]), world, rank)}
        self.wrong_heads = share(H, world, (rank + 1) % world)  # wq_wrong_shard: the next rank's query heads
        local = dict(meta, n_head=self.width("H"), n_head_kv=self.width("Hkv"))
        super().__init__(self.rank_weights(weights, int(meta["n_layer"])), local)

    def width(self, letter):
        start, stop = self.slices[letter]
        return stop - start

    def rank_weights(self, weights, n_layer):
        """The rank's slices: its rows (or columns) of each column- (row-) parallel weight, its vocabulary rows of the
        lm head, the rest whole."""
        out = dict(weights)
        for l in range(n_layer):
            for name, (axis, letter) in WEIGHT_SPLIT.items():
                start, stop = self.slices[letter]
                if name == "attn_q" and self.shard_bug == "wq_wrong_shard":
                    start, stop = self.wrong_heads
                unit = self.head_dim if letter in ("H", "Hkv") else 1
                cut = [slice(None)] * 2
                cut[axis] = slice(start * unit, stop * unit)
                key = f"blk.{l}.{name}.weight"
                out[key] = weights[key][tuple(cut)]
        start, stop = self.slices["V"]
        out["output.weight"] = weights.get("output.weight", weights["token_embd.weight"])[start:stop]
        return out

    def positions(self, n_tokens):
        pos = super().positions(n_tokens)
        decode = self.cache_k[0].shape[0] > 0
        return pos + 1 if decode and self.shard_bug == "rope_position_offset" else pos

    def append_cache(self, l, k, v):
        if self.cache_k[l].shape[0] > 0 and self.shard_bug == "kv_stale_row":
            k, v = np.zeros_like(k), np.zeros_like(v)
        super().append_cache(l, k, v)

    def recorder(self, writer):
        """put(name, array) for Engine.step: records the checkpoint as this rank holds it and returns the tensor the
        rank goes on with, which for a row-parallel output is the all-reduced sum of the ranks' partials."""

        def put(name, array):
            kind = name.rsplit("-", 1)[0]
            if kind in PARTIAL:
                writer.put(name, array, partial=True)
                total = self.all_reduce(self.rank, array)
                return array if kind == "attn_out" and self.shard_bug == "attn_allreduce_skipped" else total
            letter = SPLIT.get(kind)
            shard = {"split": letter, "shard_offset": self.slices[letter][0]} if letter else {}
            writer.put(name, array, **shard)
            return array
        return put


def run_ranks(ranks, writers, steps, all_reduce):
    """Runs every rank on its own thread over the steps [(step, ids)]; re-raises the first rank's error."""
    errors = []

    def run(rank, writer):
        try:
            for step, ids in steps:
                writer.step(step)
                rank.step(ids, rank.recorder(writer))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            errors.append(e)
            all_reduce.abort()

    threads = [threading.Thread(target=run, args=pair) for pair in zip(ranks, writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def check_inputs(args, ref):
    """Why the reference, model, world size or output directory cannot be used, or None."""
    if ref.meta["arch"] != "llama":
        return f"{args.reference}: arch '{ref.meta['arch']}': this example runs llama only"
    if diffrun.fingerprint(args.model) != ref.meta["model_fingerprint"]:
        return f"{args.model} is not the model of {args.reference} (fingerprints differ)"
    problem = layout_problem(ref.meta, args.world_size)
    if problem:
        return f"{args.model}: {problem}"
    if args.bug and not 0 <= args.bug_rank < args.world_size:
        return f"--bug-rank {args.bug_rank} is not a rank of world size {args.world_size}"
    ours = {f"rank{r}.h5" for r in range(args.world_size)}
    others = sorted(f for f in os.listdir(args.out) if f.endswith(".h5") and f not in ours) \
        if os.path.isdir(args.out) else []
    if others:
        return f"{args.out} holds other dumps ({', '.join(others)}), which compare would read as ranks of this run"
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the GGUF the reference dump was made from")
    ap.add_argument("--reference", required=True, help="diffrun's reference dump: the token ids of every step")
    ap.add_argument("--out", required=True, help="the directory the rank dumps rank0.h5 .. rank{N-1}.h5 go to")
    ap.add_argument("--world-size", type=int, required=True, help="N, the number of tensor-parallel ranks")
    ap.add_argument("--bug", choices=BUGS, help="seed one shard bug")
    ap.add_argument("--bug-rank", type=int, default=1, help="the rank holding the bug (default 1)")
    args = ap.parse_args(argv)
    try:
        ref = diffrun.open(args.reference)
    except diffrun.DumpFormatError as e:
        print(f"tp_numpy_engine: {e}", file=sys.stderr)
        return 2
    with ref:
        problem = check_inputs(args, ref)
        if problem:
            print(f"tp_numpy_engine: {problem}", file=sys.stderr)
            return 2
        steps = [(step, ref.get("tokens", step)) for step in ref.steps()]
        weights = numpy_engine.load_weights(args.model)
        world, all_reduce = args.world_size, AllReduce(args.world_size)
        ranks = [Rank(weights, ref.meta, r, world, all_reduce, args.bug if r == args.bug_rank else None)
                 for r in range(world)]
        facts = {"bug": f"{args.bug} on rank {args.bug_rank}"} if args.bug else {}
        os.makedirs(args.out, exist_ok=True)
        with contextlib.ExitStack() as stack:
            writers = [stack.enter_context(diffrun.writer.open(
                os.path.join(args.out, f"rank{r}.h5"), backend="numpy-tp", precision="f32", like=ref,
                meta={"rank": r, "world_size": world, **facts})) for r in range(world)]
            run_ranks(ranks, writers, steps, all_reduce)
    print(f"wrote {world} rank dumps to {args.out}: {len(steps)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
