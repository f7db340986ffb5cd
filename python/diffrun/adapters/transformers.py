"""Hugging Face transformers as a diffrun engine: every checkpoint of the vocabulary, teacher-forced from a reference dump.

    diffrun dump --backend cpu --precision f64 --model M.gguf --prompt "Hello" --steps 4 --out ref.h5
    python -m diffrun.adapters.transformers --model M.gguf --reference ref.h5 --out hf.h5
    diffrun compare hf.h5 ref.h5

--model is a GGUF (loaded with AutoModelForCausalLM.from_pretrained(dir, gguf_file=...), which dequantizes
it) or a Hugging Face model directory. Llama, Qwen2, Qwen3 and Gemma 3, and the mixtures of experts Qwen3-MoE,
Qwen2-MoE and Mixtral (transformers 5: experts as fused 3-D weights), eager attention and experts, float32 (or
float64) weights. The reference's token ids are fed step by step (step 0 the prompt, then one token per
decode step through past_key_values), and forward hooks plus a wrapped apply_rotary_pos_emb record embd,
inp_scaled (gemma3), attn_norm, Qcur/Kcur/Vcur, Qnorm/Knorm (qwen3, gemma3: the inputs of the RoPE),
Qrope/Krope, cache_k/cache_v, kq_soft_max, kqv_out, attn_out, attn_post_norm (gemma3), ffn_inp, ffn_norm,
ffn_gate/up, ffn_swiglu or ffn_geglu, ffn_out, ffn_post_norm (gemma3), l_out, result_norm and
result_output (the model's logits, softcapped where the model is).

Gemma 3 GGUFs: the Gemma3TextConfig is built from the GGUF's metadata as llama.cpp reads it (local
layers: every one but each 6th or attention.sliding_window_pattern, with rope.freq_base_swa and
attention.sliding_window; q·k scaled by 1/sqrt(key_length); final_logit_softcapping), since transformers'
GGUF config mapping leaves some of these at Gemma3TextConfig's defaults. The weights come from
transformers' GGUF loader when it loads the file and agrees with the gguf package's dequantization under
the names below (the norms stored as 1 + weight, as llama.cpp's converter writes them); otherwise from
the gguf package's dequantization, and the dump's `weights` attribute says which. The KV cache keeps
every position on local layers too (the mask applies the window), so cache_k, cache_v and kq_soft_max
have the reference's shapes.

Mixtures of experts: transformers' GGUF config mapping leaves moe_intermediate_size and
shared_expert_intermediate_size at their defaults, so they are set from <arch>.expert_feed_forward_length and
expert_shared_feed_forward_length; its loader's weights are checked against the gguf package's as for Gemma 3.
It reads no Mixtral GGUF (a llama with expert_count), so Mixtral is built from a MixtralConfig of the GGUF's
metadata and the gguf package's tensors (q/k rows put back in transformers' order, ffn_gate_exps and
ffn_up_exps [E, F, D] stacked into gate_up_proj [E, 2F, D]). Recorded in place of the dense FFN's kinds, where
the modules expose them: ffn_moe_logits, ffn_moe_topk and the selected weights (the router's (logits, weights,
ids)), the weights being ffn_moe_weights_norm where the model renormalises them (Qwen3-MoE, Mixtral) and
ffn_moe_weights where it does not (Qwen2-MoE), ffn_moe_out (the experts module's output); Qwen2-MoE's
ffn_shexp (the shared expert), ffn_shexp_gate_inp (its gate's logit) and ffn_out (the block's output).
transformers computes the router's probabilities, the shared expert's sigmoid and each expert's gate, up and
down inside the modules' forwards (the experts per expert over its routed tokens, not per token and slot), so
ffn_moe_probs, ffn_moe_gate/up/swiglu/down, ffn_shexp_gate and ffn_shexp_out are not recorded.

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
from diffrun import schema
from diffrun.schema import attr
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


def gguf_arch(path: Path) -> str:
    """general.architecture of a GGUF file."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def _gguf_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    if len(field.data) != 1:
        return [field.parts[i][0].item() for i in field.data]
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0].name == "STRING" else value[0].item()


# Gemma 3's GGUF tensors (llama.cpp's names) -> Gemma3ForCausalLM's, and whether the GGUF holds 1 + weight.
GEMMA3_LAYER_TENSORS = [
    ("attn_norm", "input_layernorm", True),
    ("attn_q", "self_attn.q_proj", False),
    ("attn_k", "self_attn.k_proj", False),
    ("attn_v", "self_attn.v_proj", False),
    ("attn_q_norm", "self_attn.q_norm", True),
    ("attn_k_norm", "self_attn.k_norm", True),
    ("attn_output", "self_attn.o_proj", False),
    ("post_attention_norm", "post_attention_layernorm", True),
    ("ffn_norm", "pre_feedforward_layernorm", True),
    ("ffn_gate", "mlp.gate_proj", False),
    ("ffn_up", "mlp.up_proj", False),
    ("ffn_down", "mlp.down_proj", False),
    ("post_ffw_norm", "post_feedforward_layernorm", True),
]


def gemma3_settings(path: Path) -> dict:
    """Gemma3TextConfig's arguments from a gemma3 GGUF, read as llama.cpp (and diffrun's config) reads them."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def key(suffix, default=None):
        return _gguf_value(reader, f"gemma3.{suffix}", default)

    n_layer, n_embd, n_head = int(key("block_count")), int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", n_embd // n_head))
    window = int(key("attention.sliding_window", 0))
    pattern = key("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        local = [bool(x) for x in pattern]
    else:
        local = [window > 0 and (int(pattern) == 0 or L % int(pattern) < int(pattern) - 1) for L in range(n_layer)]
    if key("rope.scaling.type", "none") not in ("none", None):
        raise ValueError(f"{path}: gemma3.rope.scaling.type '{key('rope.scaling.type')}' is not handled here")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    softcap = float(key("final_logit_softcapping", 0.0))
    return dict(
        vocab_size=int(key("vocab_size", len(tokens.data) if tokens is not None else 0)),
        hidden_size=n_embd,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=int(key("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_local_base_freq=float(key("rope.freq_base_swa", 10000.0)),
        sliding_window=window if window > 0 else None,
        layer_types=["sliding_attention" if x else "full_attention" for x in local],
        # llama.cpp: 1/sqrt(n_embd/n_head) for the 62-layer 27B, else 1/sqrt(key_length)
        query_pre_attn_scalar=(n_embd // n_head) if n_layer == 62 else head_dim,
        final_logit_softcapping=softcap if softcap > 0 else None,
        attn_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
    )


def gemma3_config(path: Path):
    """A Gemma3TextConfig from the GGUF's metadata (RoPE bases also set in rope_parameters where it has them)."""
    from transformers import Gemma3TextConfig

    s = gemma3_settings(path)
    config = Gemma3TextConfig(**s)
    config.layer_types = s["layer_types"]
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and "full_attention" in rp:
        rp["full_attention"] = {"rope_type": "default", "rope_theta": s["rope_theta"]}
        rp["sliding_attention"] = {"rope_type": "default", "rope_theta": s["rope_local_base_freq"]}
    return config


def gemma3_weights(path: Path) -> dict:
    """Gemma3ForCausalLM's state dict (float32 numpy) dequantized from the GGUF by the gguf package."""
    from gguf import GGUFReader

    tensors, dequantized = _dequantized(GGUFReader(str(path)))

    def get(name: str, minus_one: bool = False) -> np.ndarray:
        w = dequantized(name)
        return w - np.float32(1) if minus_one else w

    out = {"model.embed_tokens.weight": get("token_embd.weight"),
           "model.norm.weight": get("output_norm.weight", True)}
    if "output.weight" in tensors:
        out["lm_head.weight"] = get("output.weight")
    L = 0
    while f"blk.{L}.attn_q.weight" in tensors:
        for src, dst, minus_one in GEMMA3_LAYER_TENSORS:
            out[f"model.layers.{L}.{dst}.weight"] = get(f"blk.{L}.{src}.weight", minus_one)
        L += 1
    return out


def _dequantized(reader):
    """name -> the gguf package's dequantization of a GGUF tensor (float32, numpy shape reversed(ne))."""
    from gguf.quants import dequantize

    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> np.ndarray:
        t = tensors[name]
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        return w.reshape([int(n) for n in reversed(t.shape)])

    return tensors, get


def moe_settings(path: Path) -> dict | None:
    """A mixture of experts' facts from a GGUF (qwen3moe, qwen2moe, or llama with expert_count: Mixtral); None for
    a dense model."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = _gguf_value(reader, "general.architecture")

    def key(suffix, default=None):
        return _gguf_value(reader, f"{arch}.{suffix}", default)

    n_expert = int(key("expert_count", 0))
    if n_expert == 0 or arch not in ("qwen3moe", "qwen2moe", "llama"):
        return None
    n_embd, n_head = int(key("embedding_length")), int(key("attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return dict(
        arch=arch,
        n_layer=int(key("block_count")),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(key("attention.head_count_kv", n_head)),
        head_dim=int(key("attention.key_length", n_embd // n_head)),
        n_ctx=int(key("context_length")),
        rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=key("rope.scaling.type", "none"),
        n_vocab=int(key("vocab_size", len(tokens.data) if tokens is not None else 0)),
        n_expert=n_expert,
        n_expert_used=int(key("expert_used_count")),
        # llama.cpp: an expert of llama (Mixtral) is feed_forward_length wide
        n_ff_exp=int(key("expert_feed_forward_length", 0) or key("feed_forward_length")),
        n_ff_shexp=int(key("expert_shared_feed_forward_length", 0)),
        tied=all(t.name != "output.weight" for t in reader.tensors),
    )


def hf_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """q/k weight rows of a llama GGUF (interleaved RoPE pairs 2i, 2i+1 per head) in transformers' order (i, i+Dh/2):
    the inverse of the permutation llama.cpp's converter applies."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def moe_weights(path: Path, s: dict) -> dict:
    """The state dict (float32 numpy, transformers 5's names) of a mixture of experts, from the gguf package."""
    from gguf import GGUFReader

    tensors, get = _dequantized(GGUFReader(str(path)))
    mixtral = s["arch"] == "llama"
    out = {"model.embed_tokens.weight": get("token_embd.weight"), "model.norm.weight": get("output_norm.weight"),
           "lm_head.weight": get("output.weight") if "output.weight" in tensors else get("token_embd.weight")}
    for L in range(s["n_layer"]):
        b, h = f"blk.{L}.", f"model.layers.{L}."
        q, k = get(b + "attn_q.weight"), get(b + "attn_k.weight")
        if mixtral:
            q, k = hf_rows(q, s["n_head"]), hf_rows(k, s["n_head_kv"])
        out.update({h + "input_layernorm.weight": get(b + "attn_norm.weight"),
                    h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k,
                    h + "self_attn.v_proj.weight": get(b + "attn_v.weight"),
                    h + "self_attn.o_proj.weight": get(b + "attn_output.weight"),
                    h + "post_attention_layernorm.weight": get(b + "ffn_norm.weight"),
                    h + "mlp.gate.weight": get(b + "ffn_gate_inp.weight"),
                    # transformers 5's experts: gate rows then up rows of each expert, [E, 2F, D]
                    h + "mlp.experts.gate_up_proj": np.concatenate([get(b + "ffn_gate_exps.weight"),
                                                                    get(b + "ffn_up_exps.weight")], axis=1),
                    h + "mlp.experts.down_proj": get(b + "ffn_down_exps.weight")})
        for x in ("q", "k", "v"):
            if f"{b}attn_{x}.bias" in tensors:
                out[f"{h}self_attn.{x}_proj.bias"] = get(f"{b}attn_{x}.bias")
        for x in ("q", "k"):
            if f"{b}attn_{x}_norm.weight" in tensors:
                out[f"{h}self_attn.{x}_norm.weight"] = get(f"{b}attn_{x}_norm.weight")
        if s["n_ff_shexp"]:
            for x in ("gate", "up", "down"):
                out[f"{h}mlp.shared_expert.{x}_proj.weight"] = get(f"{b}ffn_{x}_shexp.weight")
            out[h + "mlp.shared_expert_gate.weight"] = get(b + "ffn_gate_inp_shexp.weight").reshape(1, -1)
    return out


def _mixtral_config(s: dict):
    """A MixtralConfig from a llama GGUF with experts."""
    from transformers import MixtralConfig

    config = MixtralConfig(vocab_size=s["n_vocab"], hidden_size=s["n_embd"], intermediate_size=s["n_ff_exp"],
                           num_hidden_layers=s["n_layer"], num_attention_heads=s["n_head"],
                           num_key_value_heads=s["n_head_kv"], head_dim=s["head_dim"],
                           max_position_embeddings=s["n_ctx"], rms_norm_eps=s["rms_eps"],
                           num_local_experts=s["n_expert"], num_experts_per_tok=s["n_expert_used"],
                           tie_word_embeddings=s["tied"], sliding_window=None)
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict):
        rp.update(rope_type="default", rope_theta=s["rope_theta"])
    else:
        config.rope_theta = s["rope_theta"]
    return config


def _weights_differ(model, expected: dict) -> list[str]:
    """The names of `expected` that the model's state dict lacks or holds other values for (max |diff| > 1e-6)."""
    state = model.state_dict()
    differ = []
    for name, w in expected.items():
        got = state.get(name)
        if got is None or tuple(got.shape) != w.shape:
            differ.append(f"{name} (missing or shape {None if got is None else tuple(got.shape)})")
        elif (err := float(np.max(np.abs(got.detach().float().cpu().numpy() - w)))) > 1e-6:
            differ.append(f"{name} (max |diff| {err:.3g})")
    return differ


def _built(cls, config, expected: dict, path: Path, optional=("embed_scale",)):
    """cls(config) holding `expected` (numpy); ValueError when the names or shapes do not match."""
    torch = _torch()
    hf = cls(config)
    missing, unexpected = hf.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in expected.items()},
                                             strict=False)
    missing = [k for k in missing if not k.endswith(optional)]
    if missing or unexpected:
        raise ValueError(f"{path}: {cls.__name__}'s weights do not match the GGUF's: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    return hf


def _from_gguf(path: Path, config, expected: dict, cls, dtype_kw: str, **kwargs):
    """transformers' GGUF loader's model (float32) when its weights are the gguf package's dequantization
    (`expected`), else cls(config) holding `expected`; its diffrun_weights says which, and why."""
    torch = _torch()
    from transformers import AutoModelForCausalLM

    try:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                  attn_implementation="eager", **kwargs, **{dtype_kw: torch.float32})
        differ = _weights_differ(hf, expected)
        if not differ:
            hf.diffrun_weights = "transformers GGUF loader (equal to the gguf package's dequantization)"
            return hf
        reason = f"its weights differ from the gguf package's: {', '.join(differ[:4])}" + \
            (f" and {len(differ) - 4} more" if len(differ) > 4 else "")
    except Exception as e:  # transformers' GGUF loader does not read this file
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    config._attn_implementation = "eager"
    if "experts_implementation" in kwargs:
        config._experts_implementation = kwargs["experts_implementation"]
    hf = _built(cls, config, expected, path)
    hf.diffrun_weights = f"the gguf package's dequantization (transformers GGUF loader not used: {reason})"
    return hf


def _load_moe(path: Path, s: dict, dtype_kw: str):
    """A Qwen3-MoE, Qwen2-MoE or Mixtral model (float32, eager experts) from a GGUF; see the module doc."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, MixtralForCausalLM

    expected = moe_weights(path, s)
    if s["arch"] == "llama":
        config = _mixtral_config(s)
        config._attn_implementation = "eager"
        if hasattr(config, "_experts_implementation"):
            config._experts_implementation = "eager"
        hf = _built(MixtralForCausalLM, config, expected, path)
        hf.diffrun_weights = ("the gguf package's dequantization (transformers' GGUF loader reads no llama with "
                              "experts)")
        return hf
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config.head_dim = s["head_dim"]
    config.moe_intermediate_size = s["n_ff_exp"]
    if s["n_ff_shexp"]:
        config.shared_expert_intermediate_size = s["n_ff_shexp"]
    kwargs = {"experts_implementation": "eager"} if hasattr(config, "_experts_implementation") else {}
    return _from_gguf(path, config, expected, MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], dtype_kw, **kwargs)


def _check_moe(hf, s: dict) -> str:
    """Raises ValueError where the built model does not route as the GGUF says; else a one-line summary."""
    cfg = hf.config
    n_expert = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    wrong = []
    if n_expert != s["n_expert"] or cfg.num_experts_per_tok != s["n_expert_used"]:
        wrong.append(f"{n_expert} experts, {cfg.num_experts_per_tok} per token")
    for L, layer in enumerate(hf.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None or not hasattr(experts, "gate_up_proj"):
            wrong.append(f"layer {L} has no fused experts (transformers 5 needed)")
            break
    # llama.cpp renormalises the selected weights of qwen3moe and llama (Mixtral), not of qwen2moe's
    norm = getattr(cfg, "norm_topk_prob", cfg.model_type == "mixtral")
    if norm != (s["arch"] != "qwen2moe"):
        wrong.append(f"norm_topk_prob {norm}")
    inv = getattr(hf.model.rotary_emb, "inv_freq", None)
    dh = s["head_dim"]
    if inv is None or abs(float(inv[1]) / s["rope_theta"] ** (-2.0 / dh) - 1) > 1e-6:
        wrong.append("RoPE base")
    if s["rope_scaling"] not in ("none", None):
        wrong.append(f"rope scaling '{s['rope_scaling']}' is not handled here")
    if wrong:
        raise ValueError("the transformers model does not follow the GGUF: " + "; ".join(wrong))
    shexp = f", a shared expert of width {s['n_ff_shexp']}" if s["n_ff_shexp"] else ""
    return (f"{type(hf).__name__}: {s['n_layer']} layers, {s['n_expert']} experts of width {s['n_ff_exp']}, "
            f"{s['n_expert_used']} per token, weights {'renormalised' if norm else 'as selected'}{shexp}")


def _check_gemma3(hf, s: dict) -> str:
    """Raises ValueError where the built model does not do what the GGUF says; else a one-line summary."""
    wrong = []
    core = hf.model
    for L, layer in enumerate(core.layers):
        a = layer.self_attn
        local = s["layer_types"][L] == "sliding_attention"
        if abs(a.scaling - s["query_pre_attn_scalar"] ** -0.5) > 1e-12:
            wrong.append(f"layer {L} attention scale {a.scaling}")
        if getattr(a, "sliding_window", None) != (s["sliding_window"] if local else None):
            wrong.append(f"layer {L} window {getattr(a, 'sliding_window', None)}")
    dh = s["head_dim"]
    for kind, base in (("full_attention", s["rope_theta"]), ("sliding_attention", s["rope_local_base_freq"])):
        rotary = core.rotary_emb
        inv = getattr(rotary, f"{kind}_inv_freq", None)
        if inv is None:  # transformers before per-layer-type RoPE: rotary_emb and rotary_emb_local
            rotary = getattr(core, "rotary_emb_local", None) if kind == "sliding_attention" else core.rotary_emb
            inv = getattr(rotary, "inv_freq", None)
        if inv is None:
            wrong.append(f"no RoPE table found for {kind}")
        elif abs(float(inv[1]) / base ** (-2.0 / dh) - 1) > 1e-6:
            wrong.append(f"{kind} RoPE base {float(inv[1]) ** (-dh / 2.0):.6g}, not {base:.6g}")
    if (hf.config.final_logit_softcapping or None) != s["final_logit_softcapping"]:
        wrong.append(f"final softcap {hf.config.final_logit_softcapping}")
    if wrong:
        raise ValueError("the transformers model does not follow the GGUF: " + "; ".join(wrong))
    n_local = s["layer_types"].count("sliding_attention")
    return (f"gemma3: {len(core.layers)} layers ({n_local} local, window {s['sliding_window']}), RoPE bases "
            f"{s['rope_theta']:g}/{s['rope_local_base_freq']:g}, scale 1/sqrt({s['query_pre_attn_scalar']}), "
            f"final softcap {s['final_logit_softcapping']}")


def _load_gemma3(path: Path, dtype_kw: str):
    """Gemma3ForCausalLM (float32) from a gemma3 GGUF, with a config from its metadata; see the module doc."""
    from transformers import Gemma3ForCausalLM

    config = gemma3_config(path)
    expected = gemma3_weights(path)
    if config.tie_word_embeddings:
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    return _from_gguf(path, config, expected, Gemma3ForCausalLM, dtype_kw)


def load_model(model: str | os.PathLike[str], dtype: str = "float32", device: str = "cpu"):
    """An eager-attention causal LM from a GGUF file or a Hugging Face directory, in `dtype`, in eval mode."""
    torch = _torch()
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "float64": torch.float64}[dtype]
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    path = Path(model)
    if path.is_file() and gguf_arch(path) == "gemma3":
        hf = _load_gemma3(path, dtype_kw)
        hf.diffrun_config = _check_gemma3(hf, gemma3_settings(path))
        return hf.to(torch_dtype).to(device).eval()
    if path.is_file() and (moe := moe_settings(path)) is not None:
        hf = _load_moe(path, moe, dtype_kw)
        hf.diffrun_config = _check_moe(hf, moe)
        return hf.to(torch_dtype).to(device).eval()
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
    if hasattr(config, "_experts_implementation") and (getattr(config, "num_experts", 0) or
                                                       getattr(config, "num_local_experts", 0)):
        kwargs["experts_implementation"] = "eager"
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
    """Hooks on a Llama/Qwen2/Qwen3/Gemma 3 model that put every vocabulary checkpoint of a step into a writer."""

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
        if hasattr(core.embed_tokens, "embed_scale"):
            # Gemma 3's embedding module scales its rows: embd is the rows it looks up, inp_scaled its output
            def embd(module, inputs):
                self.put("embd", torch.nn.functional.embedding(inputs[0], module.weight)[0])

            self.handles.append(core.embed_tokens.register_forward_pre_hook(embd))
            self._hook(core.embed_tokens, "inp_scaled")
        else:
            self._hook(core.embed_tokens, "embd")
        self.qk_norm = hasattr(core.layers[0].self_attn, "q_norm")
        for L, layer in enumerate(core.layers):
            a, m = layer.self_attn, layer.mlp
            self.handles.append(a.register_forward_pre_hook(lambda *_, L=L: setattr(self, "layer", L)))
            self._hook(layer.input_layernorm, f"attn_norm-{L}")
            self._hook(a.q_proj, f"Qcur-{L}", heads=self.H, permute=True)
            self._hook(a.k_proj, f"Kcur-{L}", heads=self.Hkv, permute=True)
            self._hook(a.v_proj, f"Vcur-{L}", heads=self.Hkv)
            self._hook(a.o_proj, f"kqv_out-{L}", heads=self.H, pre=True)
            self._hook(a, f"kq_soft_max-{L}", index=1)
            self._hook(a, f"attn_out-{L}", index=0)
            if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 3: norms after attention and the FFN
                self._hook(layer.post_attention_layernorm, f"attn_post_norm-{L}")
                self._hook(layer.pre_feedforward_layernorm, f"ffn_inp-{L}", pre=True)
                self._hook(layer.pre_feedforward_layernorm, f"ffn_norm-{L}")
                self._hook(layer.post_feedforward_layernorm, f"ffn_post_norm-{L}")
                act = "ffn_geglu"
            else:
                self._hook(layer.post_attention_layernorm, f"ffn_inp-{L}", pre=True)
                self._hook(layer.post_attention_layernorm, f"ffn_norm-{L}")
                act = "ffn_swiglu"
            if hasattr(m, "experts"):
                self._hook_moe(L, m)
            else:
                self._hook(m.gate_proj, f"ffn_gate-{L}")
                self._hook(m.up_proj, f"ffn_up-{L}")
                self._hook(m.down_proj, f"{act}-{L}", pre=True)
                self._hook(m.down_proj, f"ffn_out-{L}")
            self._hook(layer, f"l_out-{L}", index=0)
        self._hook(core.norm, "result_norm")
        # result_output: the model's logits (after Gemma's final softcap), put by run()
        # Qnorm/Knorm (q/k-norm models) and Qrope/Krope: the inputs and outputs of the attention module's
        # apply_rotary_pos_emb, wrapped for the time of the recording.
        self._module = sys.modules[type(core.layers[0].self_attn).__module__]
        self._rope = self._module.apply_rotary_pos_emb

        def rope(q, k, *args, **kwargs):
            if self.qk_norm:
                self.put(f"Qnorm-{self.layer}", q[0].transpose(0, 1), permute=True)
                self.put(f"Knorm-{self.layer}", k[0].transpose(0, 1), permute=True)
            qe, ke = self._rope(q, k, *args, **kwargs)
            # [B, heads, T, Dh] -> [T, heads, Dh]
            self.put(f"Qrope-{self.layer}", qe[0].transpose(0, 1), permute=True)
            self.put(f"Krope-{self.layer}", ke[0].transpose(0, 1), permute=True)
            return qe, ke

        self._module.apply_rotary_pos_emb = rope

    def _hook_moe(self, L: int, block) -> None:
        """A sparse MoE block (transformers 5): its modules' inputs are [T, D], no batch dimension."""
        torch = self.torch
        cfg = self.model.config
        # the router's selected weights: renormalised (Qwen3-MoE's norm_topk_prob, Mixtral always) or as selected
        weights = "ffn_moe_weights_norm" if getattr(cfg, "norm_topk_prob", cfg.model_type == "mixtral") \
            else "ffn_moe_weights"

        def router(_m, _inputs, output):
            logits, scores, ids = output if isinstance(output, (tuple, list)) else (output, None, None)
            self.put(f"ffn_moe_logits-{L}", logits)
            if ids is not None:  # slot j: the j-th most probable expert (torch.topk, sorted)
                self.put(f"ffn_moe_topk-{L}", ids.to(torch.float32))
                self.put(f"{weights}-{L}", scores)

        self.handles.append(block.gate.register_forward_hook(router))
        self._hook_flat(block.experts, f"ffn_moe_out-{L}")
        if hasattr(block, "shared_expert"):  # Qwen2-MoE
            self._hook_flat(block.shared_expert, f"ffn_shexp-{L}")
            self._hook_flat(block.shared_expert_gate, f"ffn_shexp_gate_inp-{L}", reshape=(-1,))
            self._hook(block, f"ffn_out-{L}")

    def _hook_flat(self, module, name: str, reshape: tuple | None = None) -> None:
        """The output of a module that sees the step's tokens as [T, ...] rows, without a batch dimension."""
        def hook(_m, _inputs, output):
            self.put(name, output.reshape(reshape) if reshape else output)

        self.handles.append(module.register_forward_hook(hook))

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


def feed(model, reference: diffrun.Dump, writer: Writer, device: str = "cpu", each=None) -> None:
    """Teacher forcing: each step's tokens of the reference through the model with one KV cache, the writer at that
    step with its tokens put; `each(out)` sees every step's model output (hooks record the rest)."""
    torch = _torch()
    cache = None
    if "sliding_attention" in (getattr(model.config, "layer_types", None) or []):
        # A cache built from the config would keep only the last window-1 positions on local layers; a plain
        # one keeps them all (the sliding-window mask is built from the config either way).
        from transformers import DynamicCache

        cache = DynamicCache()
    with torch.no_grad():
        for step in reference.steps():
            writer.step(step)
            ids = reference.get("tokens", step)
            writer.put("tokens", ids)
            out = model(input_ids=torch.tensor(ids[None, :].astype(np.int64), device=device),
                        past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            if each is not None:
                each(out)


def run(model, reference: diffrun.Dump, writer: Writer, device: str = "cpu") -> None:
    """Feeds each step's tokens of the reference through the model, recording every checkpoint."""
    rec = TransformersRecorder(model, writer, int(reference.meta[attr.n_vocab]),
                               interleaved_rope=reference.meta[attr.rope_type] == schema.ROPE_TYPES[0])

    def record(out) -> None:
        rec.put("result_output", out.logits[0], crop=rec.n_vocab)
        rec.record_cache(out.past_key_values)

    try:
        feed(model, reference, writer, device, record)
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
        if ref.meta[attr.arch] not in schema.ARCHS:
            *most, last = schema.ARCHS
            return fail(f"{args.reference}: arch '{ref.meta[attr.arch]}' is not {', '.join(most)} or {last}")
        if model_path.is_file() and diffrun.fingerprint(model_path) != ref.meta[attr.model_fingerprint]:
            return fail(f"{model_path} is not the model of {args.reference} (fingerprints differ)")
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = load_model(model_path, args.dtype, device)
        facts = {"transformers": transformers.__version__, "torch": torch.__version__, "device": device,
                 "attn_implementation": "eager"}
        if hasattr(model, "diffrun_weights"):
            facts["weights"] = model.diffrun_weights
            print(f"{model.diffrun_config}\nweights: {model.diffrun_weights}")
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
