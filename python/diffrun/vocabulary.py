"""The checkpoint vocabulary: the kinds of dump_schema.json (the table checkpoints/vocabulary.cpp reads too), their
order per config and their names. The dimension letters and their sizes are the schema's (diffrun.schema.DIMS).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from . import schema

ALL_ARCHS: tuple[str, ...] = tuple(schema.ARCHS)


@dataclass(frozen=True)
class Kind:
    base: str
    per_layer: bool
    layout: str  # dimension letters of the stored array, comma-separated
    archs: tuple[str, ...] = ALL_ARCHS
    needs: str = ""  # the feature the kind exists for ("qk_norm", "ffn_act=silu"); "" for every config
    inputs: str = ""  # dataflow inputs, as checkpoints/vocabulary.hpp describes them
    what: str = ""

    @property
    def dims(self) -> list[str]:
        return self.layout.split(",")

    def applies(self, feats: Mapping[str, object]) -> bool:
        """Whether a config with these features (schema.features) emits this kind."""
        return schema.needs_met(self.needs, feats)


def _kind(k: Mapping[str, object]) -> Kind:
    needs = str(k.get("needs", ""))
    archs = tuple(a for a in ALL_ARCHS if schema.needs_met(needs, schema.features(a)))
    return Kind(str(k["base"]), bool(k["per_layer"]), str(k["layout"]), archs, needs, str(k.get("inputs", "")),
                str(k.get("what", "")))


# Execution order within a step; per-layer kinds in their order inside a layer (the schema's order).
KINDS: tuple[Kind, ...] = tuple(_kind(k) for k in schema.SCHEMA["kinds"])

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


def names_for(feats: Mapping[str, object], n_layer: int) -> list[str]:
    """Every name a full step records for a config with these features (schema.features), in execution order."""
    applies = [k for k in KINDS if k.applies(feats)]
    names = [k.base for k in applies if not k.per_layer and k.base in _LEADING]
    for layer in range(n_layer):
        names += [checkpoint_name(k.base, layer) for k in applies if k.per_layer]
    names += [k.base for k in applies if not k.per_layer and k.base not in _LEADING]
    return names


def checkpoint_names(arch: str, n_layer: int) -> list[str]:
    """Every name a full step records for this architecture, in execution order."""
    return names_for(schema.features(arch), n_layer)


def checkpoint_order(arch: str, n_layer: int, name: str) -> int:
    """The dump's `order` attribute of `name` (its index in checkpoint_names)."""
    return checkpoint_names(arch, n_layer).index(name)


def dim_sizes(meta: Mapping[str, object], n_tokens: int, n_kv: int) -> dict[str, int]:
    """Sizes of the layout letters for a dump's root attributes (`meta`) and a step's T and S."""
    return schema.dim_sizes(meta, n_tokens, n_kv)
