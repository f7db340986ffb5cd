"""Hugging Face transformers as a diffrun engine: every checkpoint of the vocabulary, teacher-forced from a reference dump.

    diffrun dump --backend cpu --precision f64 --model M.gguf --prompt "Hello" --steps 4 --out ref.h5
    python -m diffrun.adapters.transformers --model M.gguf --reference ref.h5 --out hf.h5
    diffrun compare hf.h5 ref.h5

--model is a GGUF (loaded with AutoModelForCausalLM.from_pretrained(dir, gguf_file=...), which dequantizes
it) or a Hugging Face model directory. Llama, Qwen2 and Qwen3, eager attention, float32 (or float64)
weights. The reference's token ids are fed step by step (step 0 the prompt, then one token per decode
step through past_key_values), and forward hooks plus a wrapped apply_rotary_pos_emb record embd,
attn_norm, Qcur/Kcur/Vcur, Qnorm/Knorm (qwen3), Qrope/Krope, cache_k/cache_v, kq_soft_max, kqv_out,
attn_out, ffn_inp, ffn_norm, ffn_gate/up/swiglu, ffn_out, l_out, result_norm and result_output.

Llama GGUFs store q/k rows permuted for llama.cpp's interleaved RoPE (pairs 2i, 2i+1), which
transformers' loader undoes (its rotate_half pairs i, i+Dh/2). For a reference whose rope_type is
"norm", q and k (Qcur, Kcur, Qrope, Krope, cache_k) are put back into the GGUF's order per head so
they compare element for element. Exit status: 0 written, 2 bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

import diffrun
from diffrun.writer import Writer


def _torch():
    import torch

    return torch


def gguf_head_dim(path: Path) -> int | None:
    """<arch>.attention.key_length of a GGUF, or None (transformers' loader leaves Qwen3's head_dim at 128)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"]
    arch_name = bytes(arch.parts[arch.data[0]]).decode()
    field = reader.fields.get(f"{arch_name}.attention.key_length")
    return int(field.parts[field.data[0]][0]) if field is not None else None


def load_model(model: str | os.PathLike[str], dtype: str = "float32", device: str = "cpu"):
    """An eager-attention causal LM from a GGUF file or a Hugging Face directory, in `dtype`, in eval mode."""
    torch = _torch()
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "float64": torch.float64}[dtype]
    path = Path(model)
    kwargs: dict = {}
    if path.is_file():
        kwargs = {"gguf_file": path.name}
        config = AutoConfig.from_pretrained(str(path.parent), **kwargs)
        head_dim = gguf_head_dim(path)
        if head_dim and getattr(config, "head_dim", head_dim) != head_dim:
            config.head_dim = head_dim
        path = path.parent
    else:
        config = AutoConfig.from_pretrained(str(path))
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    hf = AutoModelForCausalLM.from_pretrained(str(path), config=config, attn_implementation="eager",
                                              **{dtype_kw: torch_dtype}, **kwargs)
    hf.to(device).eval()
    return hf


def gguf_order(x, n_heads: int):
    """[T, heads, Dh] in transformers' half-split order (i, i+Dh/2) -> the GGUF's interleaved order (2i, 2i+1)."""
    shape = x.shape
    dh = shape[-1] if x.dim() >= 3 else shape[-1] // n_heads
    y = x.reshape(*shape[:-1], -1, 2, dh // 2).transpose(-1, -2)
    return y.reshape(shape)


class TransformersRecorder:
    """Hooks on a Llama/Qwen2/Qwen3 model that put every vocabulary checkpoint of a step into a writer."""

    def __init__(self, model, writer: Writer, n_vocab: int, interleaved_rope: bool):
        torch = _torch()
        self.torch = torch
        self.model, self.writer = model, writer
        self.n_vocab, self.interleaved = n_vocab, interleaved_rope
        cfg = model.config
        self.H, self.Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.Dh = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        self.layer: int | None = None
        self.handles: list = []
        core = model.model
        self._hook(core.embed_tokens, "embd")
        for L, layer in enumerate(core.layers):
            a, m = layer.self_attn, layer.mlp
            self.handles.append(a.register_forward_pre_hook(lambda *_, L=L: setattr(self, "layer", L)))
            self._hook(layer.input_layernorm, f"attn_norm-{L}")
            self._hook(a.q_proj, f"Qcur-{L}", heads=self.H, permute=True)
            self._hook(a.k_proj, f"Kcur-{L}", heads=self.Hkv, permute=True)
            self._hook(a.v_proj, f"Vcur-{L}", heads=self.Hkv)
            if hasattr(a, "q_norm"):
                self._hook(a.q_norm, f"Qnorm-{L}", heads=self.H)
                self._hook(a.k_norm, f"Knorm-{L}", heads=self.Hkv)
            self._hook(a.o_proj, f"kqv_out-{L}", heads=self.H, pre=True)
            self._hook(a, f"kq_soft_max-{L}", index=1)
            self._hook(a, f"attn_out-{L}", index=0)
            self._hook(layer.post_attention_layernorm, f"ffn_inp-{L}", pre=True)
            self._hook(layer.post_attention_layernorm, f"ffn_norm-{L}")
            self._hook(m.gate_proj, f"ffn_gate-{L}")
            self._hook(m.up_proj, f"ffn_up-{L}")
            self._hook(m.down_proj, f"ffn_swiglu-{L}", pre=True)
            self._hook(m.down_proj, f"ffn_out-{L}")
            self._hook(layer, f"l_out-{L}", index=0)
        self._hook(core.norm, "result_norm")
        self._hook(model.lm_head, "result_output", crop=n_vocab)
        # Qrope/Krope: the attention module's apply_rotary_pos_emb, wrapped for the time of the recording.
        self._module = sys.modules[type(core.layers[0].self_attn).__module__]
        self._rope = self._module.apply_rotary_pos_emb

        def rope(q, k, *args, **kwargs):
            qe, ke = self._rope(q, k, *args, **kwargs)
            # [B, heads, T, Dh] -> [T, heads, Dh]
            self.put(f"Qrope-{self.layer}", qe[0].transpose(0, 1), permute=True)
            self.put(f"Krope-{self.layer}", ke[0].transpose(0, 1), permute=True)
            return qe, ke

        self._module.apply_rotary_pos_emb = rope

    def put(self, name: str, t, heads: int | None = None, permute: bool = False, crop: int | None = None) -> None:
        t = t.detach()
        if heads is not None:
            t = t.reshape(t.shape[0], heads, -1)
        if permute and self.interleaved:
            t = gguf_order(t, t.shape[-2])
        if crop is not None:
            t = t[..., :crop]
        self.writer.put(name, t.to("cpu").contiguous().numpy())

    def _hook(self, module, name: str, heads: int | None = None, permute: bool = False, pre: bool = False,
              index: int | None = None, crop: int | None = None) -> None:
        def hook(_m, inputs, output=None):
            value = inputs[0] if pre else output
            if index is not None and isinstance(value, (tuple, list)):
                value = value[index]
            elif isinstance(value, (tuple, list)):
                value = value[0]
            self.put(name, value[0], heads, permute, crop)  # batch of one

        self.handles.append(module.register_forward_pre_hook(hook) if pre else module.register_forward_hook(hook))

    def record_cache(self, cache) -> None:
        """cache_k-L / cache_v-L: the KV cache after the step, [S, Hkv, Dh]."""
        for L in range(len(self.model.model.layers)):
            if hasattr(cache, "layers"):
                k, v = cache.layers[L].keys, cache.layers[L].values
            else:
                k, v = cache.key_cache[L], cache.value_cache[L]
            self.put(f"cache_k-{L}", k[0].transpose(0, 1), permute=True)
            self.put(f"cache_v-{L}", v[0].transpose(0, 1))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self._module.apply_rotary_pos_emb = self._rope


def run(model, reference: diffrun.Dump, writer: Writer, device: str = "cpu") -> None:
    """Feeds each step's tokens of the reference through the model, recording every checkpoint."""
    torch = _torch()
    rec = TransformersRecorder(model, writer, int(reference.meta["n_vocab"]),
                               interleaved_rope=reference.meta["rope_type"] == "norm")
    cache = None
    try:
        with torch.no_grad():
            for step in reference.steps():
                writer.step(step)
                ids = reference.get("tokens", step)
                writer.put("tokens", ids)
                out = model(input_ids=torch.tensor(ids[None, :].astype(np.int64), device=device),
                            past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                rec.record_cache(cache)
    finally:
        rec.remove()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diffrun.adapters.transformers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file or a Hugging Face model directory")
    ap.add_argument("--reference", required=True, help="diffrun's reference dump (token ids of every step)")
    ap.add_argument("--out", required=True, help="the dump to write")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    args = ap.parse_args(argv)

    def fail(msg: str) -> int:
        print(f"diffrun.adapters.transformers: {msg}", file=sys.stderr)
        return 2

    try:
        torch = _torch()
        import transformers
    except ImportError as e:
        return fail(f"needs torch and transformers ({e})")
    model_path = Path(args.model)
    if not model_path.exists():
        return fail(f"{model_path}: no such file or directory")
    try:
        ref = diffrun.open(args.reference)
    except diffrun.DumpFormatError as e:
        return fail(str(e))
    with ref:
        if ref.meta["arch"] not in ("llama", "qwen2", "qwen3"):
            return fail(f"{args.reference}: arch '{ref.meta['arch']}' is not llama, qwen2 or qwen3")
        if model_path.is_file() and diffrun.fingerprint(model_path) != ref.meta["model_fingerprint"]:
            return fail(f"{model_path} is not the model of {args.reference} (fingerprints differ)")
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = load_model(model_path, args.dtype, device)
        facts = {"transformers": transformers.__version__, "torch": torch.__version__, "device": device,
                 "attn_implementation": "eager"}
        if device.startswith("cuda"):
            facts["device"] = torch.cuda.get_device_name()
            facts["tf32"] = "on" if torch.backends.cuda.matmul.allow_tf32 else "off"
        precision = {"float32": "f32", "float64": "f64"}[args.dtype]
        with diffrun.writer.open(args.out, backend="transformers", precision=precision, like=ref,
                                 meta=facts) as w:
            run(model, ref, w, device)
        print(f"wrote {args.out}: {len(ref.steps())} steps of {type(model).__name__} ({args.dtype}, {device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
