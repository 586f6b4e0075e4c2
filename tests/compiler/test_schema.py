"""The spec schema itself: valid JSON Schema 2020-12, and closed everywhere.

Every object schema either forbids unknown keys (`additionalProperties: false`) or is a map
keyed by user-chosen names (params, components, backends, layer kinds, dtypes), in which case the
names are constrained by `propertyNames` and the values by an `additionalProperties` schema.
"""

from __future__ import annotations

import json

from jsonschema import Draft202012Validator
from pdc.compiler.schema import SCHEMA_PATH

MAPS_KEYED_BY_USER_NAMES = {"params", "components", "backends", "kinds", "dtypes", "names",
                            # the `parity` block's (Note [Parity recipe])
                            "config", "cache", "carry", "carry_rows", "tensors", "segments",
                            "flags"}
# A map keyed by what users name after something else: flags by a cache attribute path.
KEYED_BY_ATTRIBUTE = {"flags"}


def _schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


def _object_schemas(node, path=()):
    """(path, schema) for every subschema that describes a mapping."""
    if isinstance(node, dict):
        if node.get("type") == "object" or "properties" in node or "additionalProperties" in node:
            yield path, node
        for key, value in node.items():
            if key in ("enum", "const", "required", "description"):
                continue
            yield from _object_schemas(value, path + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _object_schemas(value, path + (i,))


def test_schema_is_valid_draft_2020_12():
    schema = _schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(schema)


def test_every_object_is_closed_or_a_map_of_user_names():
    objects = list(_object_schemas(_schema()))
    assert len(objects) > 15  # the walk does reach the nested definitions
    maps = set()
    for path, schema in objects:
        extra = schema.get("additionalProperties")
        if extra is False:
            assert "propertyNames" not in schema, path
            continue
        name = path[-1]
        assert name in MAPS_KEYED_BY_USER_NAMES, f"{'/'.join(map(str, path))} is not closed"
        if name in KEYED_BY_ATTRIBUTE:
            assert schema["propertyNames"]["type"] == "string", path
        else:
            assert schema["propertyNames"] == {"$ref": "#/$defs/name"}, path
        assert isinstance(extra, dict) and extra, path
        assert "properties" not in schema, path
        maps.add(name)
    assert maps == MAPS_KEYED_BY_USER_NAMES


def test_the_walk_finds_a_schema_that_is_left_open():
    """The closedness check itself fails on an open object (guards the walk above)."""
    schema = _schema()
    schema["$defs"]["item"].pop("additionalProperties")
    open_ = [p for p, s in _object_schemas(schema) if s.get("additionalProperties") is not False
             and p[-1] not in MAPS_KEYED_BY_USER_NAMES]
    assert open_ == [("$defs", "item")]
