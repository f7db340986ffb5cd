"""The dump format as data: dump_schema.json (shipped with the package; the C++ build embeds the same file).

Everything the Python package knows of the format's attributes, dimension letters, architectures and checkpoint
kinds comes from here: the reader (diffrun.dump), the writer (diffrun.writer), the validator (diffrun.validate) and
the vocabulary (diffrun.vocabulary).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

SCHEMA: dict[str, Any] = json.loads((Path(__file__).resolve().parent / "dump_schema.json").read_text("utf-8"))

FORMAT: str = SCHEMA["format"]
FORMAT_VERSION: int = SCHEMA["format_version"]  # what the writers write
FORMAT_VERSIONS: tuple[int, ...] = tuple(range(SCHEMA["oldest_format_version"], FORMAT_VERSION + 1))  # what readers read
TYPES: dict[str, dict[str, str]] = SCHEMA["types"]
ATTRIBUTE_TABLE: str = SCHEMA["attribute_table"]  # version 2: a step group's dataset attributes, one row per dataset

# Architectures and the features each implies (the flags ModelConfig::set_arch_features sets).
ARCHS: dict[str, dict[str, Any]] = {a["name"]: {k: v for k, v in a.items() if k != "name"} for a in SCHEMA["archs"]}
FEATURES: dict[str, dict[str, Any]] = {f["name"]: f for f in SCHEMA["features"]}
# RoPE's pairing: ("norm", "neox"), pairs (2i, 2i+1) then pairs (i, i + Dh/2).
ROPE_TYPES: tuple[str, ...] = tuple(FEATURES["rope_type"]["values"])

# Dimension letters: the root attribute giving each one's size, or None for the step's T and S.
DIMS: dict[str, str | None] = {d["letter"]: d.get("attribute") for d in SCHEMA["dims"]}
STEP_DIMS = tuple(d["letter"] for d in SCHEMA["dims"] if "attribute" not in d)  # ("T", "S")
ROW_DIM, CACHE_DIM = STEP_DIMS  # token rows, cache rows
HEAD_DIMS = tuple(d["letter"] for d in SCHEMA["dims"] if d.get("heads"))  # ("H", "Hkv")
HEAD_DIM = next(d["letter"] for d in SCHEMA["dims"] if d.get("head_dim"))  # "Dh"


@dataclass(frozen=True)
class Attribute:
    """A root attribute or a dataset attribute (a column of a step's attribute table)."""
    name: str
    type: str  # a key of TYPES: "string", "integer", "real", "boolean", "integer array"
    required: bool = False
    values: tuple[str, ...] | None = None  # the allowed strings of an enum string
    config: bool = False  # part of the model config (`arch` .. `qk_norm`)
    max: int | None = None
    max_why: str = ""
    positive: bool = False
    divides: str | None = None
    ids: bool = False  # token ids: within 0..n_vocab-1
    nonempty: str | None = None  # why it must not be empty

    @property
    def expected(self) -> str:
        """What a validator says it expected: "a string: \"norm\" or \"neox\"", "an int32 scalar"."""
        text = TYPES[self.type]["expected"]
        return f"{text}: {quoted(self.values)}" if self.values else text


def quoted(values: tuple[str, ...] | list[str]) -> str:
    """'"a", "b" or "c"'."""
    out = ""
    for i, v in enumerate(values):
        out += ("" if i == 0 else " or " if i + 1 == len(values) else ", ") + f'"{v}"'
    return out


def _values(spec: Any) -> tuple[str, ...] | None:
    if spec is None:
        return None
    if spec == "archs":
        return tuple(ARCHS)
    if isinstance(spec, str) and spec.startswith("features."):
        return tuple(FEATURES[spec.split(".", 1)[1]]["values"])
    return tuple(spec)


def _attribute(a: Mapping[str, Any]) -> Attribute:
    return Attribute(a["name"], a["type"], a.get("required", False), _values(a.get("values")), a.get("config", False),
                     a.get("max"), a.get("max_why", ""), a.get("positive", False), a.get("divides"), a.get("ids", False),
                     a.get("nonempty"))


ROOT_ATTRIBUTES: tuple[Attribute, ...] = tuple(_attribute(a) for a in SCHEMA["root_attributes"])
ROOT: dict[str, Attribute] = {a.name: a for a in ROOT_ATTRIBUTES}
CONFIG_ATTRIBUTES: tuple[Attribute, ...] = tuple(a for a in ROOT_ATTRIBUTES if a.config)
DATASET_ATTRIBUTES: dict[str, Attribute] = {a["name"]: _attribute(a) for a in SCHEMA["dataset_attributes"]}
NATIVE_DTYPES: tuple[str, ...] = DATASET_ATTRIBUTES["native_dtype"].values or ()
BF16_MARK: str = (DATASET_ATTRIBUTES["dtype"].values or ("",))[0]  # the dtype column's one value


class Names:
    """The schema's names of one kind as attributes: `attr.backend == "backend"`. A name the schema does not define
    is an AttributeError, so a name dropped or renamed in the schema fails every use of it at once."""

    def __init__(self, what: str, names: list[str]):
        self._what = what
        self._names = dict.fromkeys(names)

    def __getattr__(self, name: str) -> str:
        if name.startswith("_") or name not in self._names:
            raise AttributeError(f"the dump schema has no {self._what} {name!r}")
        return name

    def __iter__(self):
        return iter(self._names)


attr = Names("root attribute", [a["name"] for a in SCHEMA["root_attributes"] + SCHEMA["backend_root_attributes"]])
column = Names("dataset attribute", [a["name"] for a in SCHEMA["dataset_attributes"]])
dim = Names("dimension letter", [d["letter"] for d in SCHEMA["dims"]])


def dim_sizes(meta: Mapping[str, object], n_tokens: int, n_kv: int) -> dict[str, int]:
    """Sizes of the layout letters for a dump's root attributes (`meta`) and a step's T and S."""
    sizes = {ROW_DIM: n_tokens, CACHE_DIM: n_kv}
    # An optional size (the experts' of a dense model) is absent: 0.
    sizes.update({letter: int(meta.get(attr, 0)) for letter, attr in DIMS.items() if attr})  # type: ignore[arg-type]
    return sizes


def features(arch: str, **overrides: Any) -> dict[str, Any]:
    """The features of an architecture, with those a dump's attributes state (qk_norm, ...) overriding them."""
    f = dict(ARCHS[arch])
    f.update(overrides)
    return f


def stated_features(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The features of a dump's architecture, with those its root attributes state (qk_norm, n_expert: a llama with
    experts is a mixture of experts, ...) taken from them."""
    stated = {f["name"]: meta[f["attribute"]] for f in FEATURES.values() if f.get("attribute") in meta}
    return features(str(meta[attr.arch]), **{k: v if isinstance(v, str) else bool(v) for k, v in stated.items()})


def needs_met(needs: str, feats: Mapping[str, Any]) -> bool:
    """Whether a kind's `needs` ("", "qk_norm", "ffn_act=silu", "!moe", "ffn_act=silu&!moe", "!moe|moe_shexp")
    holds for these features: "a|b" either (binds loosest), "a&b" both, "!a" a feature that is false or absent."""
    if not needs:
        return True
    if "|" in needs:
        return any(needs_met(n, feats) for n in needs.split("|"))
    if "&" in needs:
        return all(needs_met(n, feats) for n in needs.split("&"))
    if needs.startswith("!"):
        return not needs_met(needs[1:], feats)
    name, sep, value = needs.partition("=")
    return feats.get(name) == value if sep else bool(feats.get(name))
