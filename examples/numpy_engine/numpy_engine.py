#!/usr/bin/env python3
"""numpy_engine.py: a minimal outside engine (llama, numpy, float32) that writes a diffrun dump.

It reads the weights of a GGUF with the `gguf` package, takes the token ids of every step from a
diffrun reference dump (teacher forcing), runs the prefill and the KV-cached decode steps, and records
every checkpoint of diffrun's vocabulary through the public Python API (diffrun.open, diffrun.writer):

    diffrun dump --backend cpu --precision f64 --model M.gguf --prompt "Hello" --steps 4 --out ref.h5
    python3 examples/numpy_engine/numpy_engine.py --model M.gguf --reference ref.h5 --out mine.h5
    diffrun compare mine.h5 ref.h5

--isolated ISO.h5 also writes the isolation replay: each op is run again on the reference's inputs (every
recorded tensor is replaced by the reference's before the next op reads it), so each checkpoint of ISO.h5 is
that op's own, local error; `diffrun compare mine.h5 ref.h5 --isolated ISO.h5` adds it to the report.

--bug NAME seeds one bug, to see how diffrun reports it:
    rope_neox     RoPE rotates pairs (i, i+Dh/2) instead of llama's (2i, 2i+1)  -> Qrope-0
    gqa_modulo    query head h reads KV head h % Hkv instead of h // (H/Hkv)     -> kq_soft_max-0
    cache_unread  decode steps attend to their own token only                   -> kq_soft_max-0 at step 1
Exit status: 0 written, 2 bad input.
"""

import argparse
import contextlib
import sys

import numpy as np

import diffrun

BUGS = ("rope_neox", "gqa_modulo", "cache_unread")


def load_weights(path):
    """name -> float32 array in numpy order (GGUF's ne reversed): a weight [out, in] gives y = x @ w.T."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    weights = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        weights[t.name] = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
    return weights


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, theta, neox):
    """x [T, nh, Dh] rotated by angle pos * theta^(-2i/Dh) for pair i."""
    dh = x.shape[-1]
    angle = pos[:, None, None] * theta ** (-np.arange(0, dh, 2, dtype=np.float64) / dh)
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    a, b = (x[..., : dh // 2], x[..., dh // 2:]) if neox else (x[..., 0::2], x[..., 1::2])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    return np.concatenate([ra, rb], -1) if neox else np.stack([ra, rb], -1).reshape(x.shape)


class Engine:
    def __init__(self, weights, meta, bug=None):
        self.w, self.bug = weights, bug
        self.L, self.H, self.Hkv = int(meta["n_layer"]), int(meta["n_head"]), int(meta["n_head_kv"])
        self.Dh, self.V = int(meta["head_dim"]), int(meta["n_vocab"])
        self.eps, self.theta = np.float32(meta["rms_eps"]), float(meta["rope_theta"])
        self.cache_k = [np.zeros((0, self.Hkv, self.Dh), np.float32) for _ in range(self.L)]
        self.cache_v = [np.zeros((0, self.Hkv, self.Dh), np.float32) for _ in range(self.L)]

    def step(self, ids, put):
        """One forward pass over the step's ids; put(name, array) records a checkpoint and returns the tensor the
        pass goes on with: the array itself, or in the isolation replay the reference's tensor of that name."""
        put("tokens", np.asarray(ids, np.int32))
        x = self.w["token_embd.weight"][ids]
        x = put("embd", x)
        pos = self.positions(len(ids))
        for l in range(self.L):
            x = self.layer(l, x, pos, put)
        x = rms_norm(x, self.w["output_norm.weight"], self.eps)
        x = put("result_norm", x)
        lm_head = self.w.get("output.weight", self.w["token_embd.weight"])
        put("result_output", (x @ lm_head.T)[:, : self.V])

    def positions(self, n_tokens):
        """The positions of a step's tokens: those after the rows already in the KV cache."""
        past = self.cache_k[0].shape[0]
        return np.arange(past, past + n_tokens, dtype=np.float64)

    def append_cache(self, l, k, v):
        """Writes the step's keys and values [T, Hkv, Dh] into layer l's KV cache, after its rows."""
        self.cache_k[l] = np.concatenate([self.cache_k[l], k])
        self.cache_v[l] = np.concatenate([self.cache_v[l], v])

    def layer(self, l, x, pos, put):
        w = {k[len(f"blk.{l}."):-len(".weight")]: v for k, v in self.w.items() if k.startswith(f"blk.{l}.")}
        T, H, Hkv, Dh = x.shape[0], self.H, self.Hkv, self.Dh
        xn = rms_norm(x, w["attn_norm"], self.eps)
        xn = put(f"attn_norm-{l}", xn)
        q = (xn @ w["attn_q"].T).reshape(T, H, Dh)
        k = (xn @ w["attn_k"].T).reshape(T, Hkv, Dh)
        v = (xn @ w["attn_v"].T).reshape(T, Hkv, Dh)
        q, k, v = put(f"Qcur-{l}", q), put(f"Kcur-{l}", k), put(f"Vcur-{l}", v)
        q = rope(q, pos, self.theta, self.bug == "rope_neox")
        k = rope(k, pos, self.theta, self.bug == "rope_neox")
        q, k = put(f"Qrope-{l}", q), put(f"Krope-{l}", k)
        self.append_cache(l, k, v)
        self.cache_k[l] = put(f"cache_k-{l}", self.cache_k[l])
        self.cache_v[l] = put(f"cache_v-{l}", self.cache_v[l])
        keys, values = self.cache_k[l], self.cache_v[l]
        S, past = keys.shape[0], keys.shape[0] - T
        group = H // Hkv
        kv_head = np.arange(H) % Hkv if self.bug == "gqa_modulo" else np.arange(H) // group
        scores = np.einsum("thd,shd->hts", q, keys[:, kv_head]) / np.float32(np.sqrt(Dh))
        mask = np.arange(S)[None, :] > (past + np.arange(T))[:, None]  # key after the query's position
        if self.bug == "cache_unread":
            mask = mask | (np.arange(S) < past)[None, :]  # the cache's earlier rows are never read
        scores = np.where(mask[None], -np.inf, scores)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs = (probs / probs.sum(-1, keepdims=True)).astype(np.float32)
        probs = put(f"kq_soft_max-{l}", probs)
        kqv = np.einsum("hts,shd->thd", probs, values[:, kv_head])
        kqv = put(f"kqv_out-{l}", kqv)
        attn_out = kqv.reshape(T, H * Dh) @ w["attn_output"].T
        attn_out = put(f"attn_out-{l}", attn_out)
        x = x + attn_out
        x = put(f"ffn_inp-{l}", x)
        xn = rms_norm(x, w["ffn_norm"], self.eps)
        xn = put(f"ffn_norm-{l}", xn)
        gate, up = xn @ w["ffn_gate"].T, xn @ w["ffn_up"].T
        gate, up = put(f"ffn_gate-{l}", gate), put(f"ffn_up-{l}", up)
        swiglu = gate / (np.float32(1) + np.exp(-gate)) * up
        swiglu = put(f"ffn_swiglu-{l}", swiglu)
        ffn_out = swiglu @ w["ffn_down"].T
        ffn_out = put(f"ffn_out-{l}", ffn_out)
        x = x + ffn_out
        return put(f"l_out-{l}", x)


def recorder(writer, reference=None, step=None):
    """put(name, array) for Engine.step: writes the array to `writer` and returns the tensor the pass goes on with,
    the array itself or, given the reference dump, the reference's tensor of that name and step (the replay)."""
    held = set(reference.names(step)) - {"tokens"} if reference is not None else set()

    def put(name, array):
        writer.put(name, array)
        if name not in held:
            return array
        theirs = reference.get(name, step).astype(np.float32)
        return theirs if theirs.shape == array.shape else array  # a wrong shape is the comparison's to report
    return put


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the GGUF the reference dump was made from")
    ap.add_argument("--reference", required=True, help="diffrun's reference dump: the token ids of every step")
    ap.add_argument("--out", required=True, help="the dump this engine writes")
    ap.add_argument("--isolated", metavar="ISO", help="also write the isolation replay's dump (local errors)")
    ap.add_argument("--bug", choices=BUGS, help="seed one bug")
    args = ap.parse_args(argv)
    try:
        ref = diffrun.open(args.reference)
    except diffrun.DumpFormatError as e:
        print(f"numpy_engine: {e}", file=sys.stderr)
        return 2
    with ref:
        if ref.meta["arch"] != "llama":
            print(f"numpy_engine: {args.reference}: arch '{ref.meta['arch']}': this example runs llama only",
                  file=sys.stderr)
            return 2
        if diffrun.fingerprint(args.model) != ref.meta["model_fingerprint"]:
            print(f"numpy_engine: {args.model} is not the model of {args.reference} (fingerprints differ)",
                  file=sys.stderr)
            return 2
        weights = load_weights(args.model)
        engine, replay = Engine(weights, ref.meta, args.bug), Engine(weights, ref.meta, args.bug)
        facts = {"bug": args.bug} if args.bug else {}
        with contextlib.ExitStack() as stack:
            out = stack.enter_context(diffrun.writer.open(args.out, backend="numpy", precision="f32", like=ref,
                                                          meta=facts))
            iso = args.isolated and stack.enter_context(
                diffrun.writer.open(args.isolated, backend="numpy", precision="f32", like=ref, meta=facts))
            for step in ref.steps():
                ids = ref.get("tokens", step)
                out.step(step)
                engine.step(ids, recorder(out))
                if iso:
                    iso.step(step)
                    replay.step(ids, recorder(iso, ref, step))
    print(f"wrote {args.out}{' and ' + args.isolated if args.isolated else ''}: {len(ref.steps())} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
