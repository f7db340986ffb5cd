"""dump_schema.json is the one definition of the dump format: docs/dump-format.md's tables (root attributes,
dataset attributes, dimension letters, checkpoint vocabulary) and the C API header's architecture list say what it
says, and the package's tables (vocabulary, validator, writer) are its own."""

from __future__ import annotations

import re
from pathlib import Path

from diffrun import schema, validate, vocabulary, writer

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "dump-format.md").read_text()

# The doc's words for the schema's types.
DOC_TYPES = {"string": "string", "integer": "integer", "real": "real", "boolean": "boolean",
             "integer array": "integer array"}


def table(heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first table under a heading of the doc."""
    part = DOC.split(heading, 1)[1]
    rows = []
    for line in part.splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("|") and not line.startswith("| ---"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows and not line.startswith("|"):
            break
    return rows[1:]  # the header row aside


def name(cell: str) -> str | None:
    m = re.fullmatch(r"`([^`]+)`", cell)
    return m.group(1) if m else None


def test_the_docs_root_attributes_are_the_schemas():
    rows = [r for r in table("## Root attributes") if name(r[0])]
    doc = {name(r[0]): r for r in rows}
    documented_extras = {a["name"]: a for a in schema.SCHEMA["backend_root_attributes"]}
    assert list(doc) == [a.name for a in schema.ROOT_ATTRIBUTES] + [n for n in documented_extras if n in doc]
    for a in schema.ROOT_ATTRIBUTES:
        kind, value = doc[a.name][1], doc[a.name][2]
        assert ("optional" in kind) == (not a.required), a.name
        base = kind.replace(", optional", "")
        if a.values and a.name != "format":
            assert base == "enum string", a.name
            for v in a.values:
                assert f'`"{v}"`' in value, (a.name, v)
        else:
            assert base == DOC_TYPES[a.type], a.name
    for n, a in documented_extras.items():
        if n in doc:
            assert doc[n][1].replace(", optional", "") == DOC_TYPES[a["type"]], n


def test_the_docs_dataset_attributes_are_the_schemas():
    rows = table("### Dataset attributes: the attribute table")
    doc = {name(r[0]): r for r in rows}
    assert list(doc) == list(schema.DATASET_ATTRIBUTES)
    for n, a in schema.DATASET_ATTRIBUTES.items():
        assert doc[n][1] == ("enum string" if a.values and len(a.values) > 1 else DOC_TYPES[a.type]), n
        for v in a.values or ():
            assert f'"{v}"' in doc[n][3], (n, v)


def test_the_docs_dimension_letters_are_the_schemas():
    rows = table("### Layouts and dimension letters")
    doc = {name(r[0]): r[1] for r in rows}
    assert list(doc) == list(schema.DIMS)
    for letter, attribute in schema.DIMS.items():
        if attribute:
            assert doc[letter] == f"`{attribute}`", letter


def test_the_docs_vocabulary_is_the_schemas():
    rows = table("## Checkpoint vocabulary")
    doc = [(name(r[0]), name(r[1])) for r in rows]
    assert doc == [(k.base + ("-L" if k.per_layer else ""), k.layout) for k in vocabulary.KINDS]


def test_the_c_headers_architectures_are_the_schemas():
    header = (REPO / "capi" / "include" / "diffrun" / "dump_writer.h").read_text()
    listed = re.search(r"arch \(([^)]*)\)", header).group(1)
    assert re.findall(r'"([^"]+)"', listed) == list(schema.ARCHS)


def test_the_packages_tables_come_from_the_schema():
    assert vocabulary.ALL_ARCHS == tuple(schema.ARCHS)
    assert [k.base for k in vocabulary.KINDS] == [k["base"] for k in schema.SCHEMA["kinds"]]
    assert validate.ROOT_ATTRIBUTES == schema.ROOT_ATTRIBUTES
    assert list(writer.ROOT_ATTRIBUTES) == [a.name for a in schema.ROOT_ATTRIBUTES if a.required]
    assert validate.MAX_LAYERS == schema.ROOT["n_layer"].max
    assert schema.FORMAT_VERSIONS == (1, 2)
    # Every kind's letters are the schema's; the letters a config gives a size are its attributes.
    for k in vocabulary.KINDS:
        assert set(k.dims) <= set(schema.DIMS), k.base
    assert all(schema.DIMS[d] in schema.ROOT for d in schema.DIMS if schema.DIMS[d])
