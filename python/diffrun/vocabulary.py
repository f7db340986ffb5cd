"""The checkpoint vocabulary, mirrored from checkpoints/vocabulary.cpp (checked against it by the tests).

Dims: T tokens of the step, S positions attended (KV cache length after the step), D n_embd,
H n_head, Hkv n_head_kv, Dh head_dim, F n_ff, V n_vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

ALL_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
SILU_ARCHS = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class Kind:
    base: str
    per_layer: bool
    layout: str  # dimension letters of the stored array, comma-separated
    archs: tuple[str, ...] = ALL_ARCHS

    @property
    def dims(self) -> list[str]:
        return self.layout.split(",")


# Execution order within a step; per-layer kinds in their order inside a layer.
KINDS: tuple[Kind, ...] = (
    Kind("tokens", False, "T"),
    Kind("embd", False, "T,D"),
    Kind("inp_scaled", False, "T,D", ("gemma3",)),
    Kind("attn_norm", True, "T,D"),
    Kind("Qcur", True, "T,H,Dh"),
    Kind("Kcur", True, "T,Hkv,Dh"),
    Kind("Vcur", True, "T,Hkv,Dh"),
    Kind("Qnorm", True, "T,H,Dh", ("qwen3", "gemma3")),
    Kind("Knorm", True, "T,Hkv,Dh", ("qwen3", "gemma3")),
    Kind("Qrope", True, "T,H,Dh"),
    Kind("Krope", True, "T,Hkv,Dh"),
    Kind("cache_k", True, "S,Hkv,Dh"),
    Kind("cache_v", True, "S,Hkv,Dh"),
    Kind("kq_soft_max", True, "H,T,S"),
    Kind("kqv_out", True, "T,H,Dh"),
    Kind("attn_out", True, "T,D"),
    Kind("attn_post_norm", True, "T,D", ("gemma3",)),
    Kind("ffn_inp", True, "T,D"),
    Kind("ffn_norm", True, "T,D"),
    Kind("ffn_gate", True, "T,F"),
    Kind("ffn_up", True, "T,F"),
    Kind("ffn_swiglu", True, "T,F", SILU_ARCHS),
    Kind("ffn_geglu", True, "T,F", ("gemma3",)),
    Kind("ffn_out", True, "T,D"),
    Kind("ffn_post_norm", True, "T,D", ("gemma3",)),
    Kind("l_out", True, "T,D"),
    Kind("result_norm", False, "T,D"),
    Kind("result_output", False, "T,V"),
)

_BY_BASE = {k.base: k for k in KINDS}
# Kinds outside layers listed before the first per-layer kind (tokens, embd, inp_scaled) run before the layers.
_LEADING = {k.base for k in KINDS[:next(i for i, k in enumerate(KINDS) if k.per_layer)]}


def find_kind(base: str) -> Kind | None:
    return _BY_BASE.get(base)


def parse_name(name: str) -> tuple[str, int]:
    """'Qcur-3' -> ('Qcur', 3); 'embd' -> ('embd', -1)."""
    base, sep, layer = name.rpartition("-")
    if sep and base and layer.isdigit():
        return base, int(layer)
    return name, -1


def checkpoint_name(base: str, layer: int) -> str:
    return f"{base}-{layer}" if layer >= 0 else base


def checkpoint_names(arch: str, n_layer: int) -> list[str]:
    """Every name a full step records for this architecture, in execution order."""
    applies = [k for k in KINDS if arch in k.archs]
    names = [k.base for k in applies if not k.per_layer and k.base in _LEADING]
    for layer in range(n_layer):
        names += [checkpoint_name(k.base, layer) for k in applies if k.per_layer]
    names += [k.base for k in applies if not k.per_layer and k.base not in _LEADING]
    return names


def checkpoint_order(arch: str, n_layer: int, name: str) -> int:
    """The dump's `order` attribute of `name` (its index in checkpoint_names)."""
    return checkpoint_names(arch, n_layer).index(name)


def dim_sizes(meta: Mapping[str, object], n_tokens: int, n_kv: int) -> dict[str, int]:
    """Sizes of the layout letters for a dump's root attributes (`meta`) and a step's T and S."""
    return {
        "T": n_tokens,
        "S": n_kv,
        "D": int(meta["n_embd"]),
        "H": int(meta["n_head"]),
        "Hkv": int(meta["n_head_kv"]),
        "Dh": int(meta["head_dim"]),
        "F": int(meta["n_ff"]),
        "V": int(meta["n_vocab"]),
    }
