"""has_finite_instance: False exactly when no finite JSON value fits (a `$ref` loop with no way
out), and True for whatever it cannot follow: it must never refuse a schema that has an instance."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.serving.finite_schemas import has_finite_instance

pytestmark = pytest.mark.model_free  # no model, no server: in the fast subset

NODE = {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}}}


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"$ref": "#/$defs/x", "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}}},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"$ref": "#"}], "minItems": 2},
    {"anyOf": [{"$ref": "#"}]}, {"allOf": [{"type": "object"}, {"$ref": "#"}]},
    {"type": "object", "additionalProperties": {"$ref": "#"}, "required": ["b"]},
    {"type": "object", "properties": {"a": {"$ref": "#/properties/b"}, "b": {"$ref": "#/properties/a"}},
     "required": ["a"]},
    {"$ref": "#/$defs/node", "$defs": {"node": {**NODE, "required": ["v", "next"]}}},
    False,
])
def test_a_loop_with_no_way_out_has_no_finite_instance(schema: Any) -> None:
    assert has_finite_instance(schema) is False


@pytest.mark.parametrize("schema", [
    True, {}, {"type": "object", "properties": {"a": {"$ref": "#"}}},
    {"type": "array", "items": {"$ref": "#"}},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"$ref": "#"}], "minItems": 1},
    {"anyOf": [{"$ref": "#"}, {"type": "integer"}]},
    {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # no type: a number fits
    {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "object", "patternProperties": {"x": {"$ref": "#"}}, "required": ["b"]},  # not followed
    {"$ref": "#/$defs/missing"}, {"$ref": "other.json#/x"},  # the grammar engine reports these itself
    {"$ref": "#/$defs/node", "$defs": {"node": {**NODE, "required": ["v"]}}},
    {"$ref": "#/$defs/node", "$defs": {"node": {**NODE, "required": ["v", "next"], "properties": {
        "v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}}},
    {"type": "object", "properties": {"a/b": {"type": "string"}}, "$ref": "#/properties/a~1b"},
])
def test_a_schema_with_a_way_out_has_a_finite_instance(schema: Any) -> None:
    assert has_finite_instance(schema) is True


def test_a_long_chain_of_refs_is_followed_without_recursion() -> None:
    chain: dict[str, Any] = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(20_000)},
                             "$ref": "#/$defs/d0"}
    chain["$defs"]["d20000"] = {"type": "integer"}
    assert has_finite_instance(chain) is True
    chain["$defs"]["d20000"] = {"$ref": "#/$defs/d0"}
    assert has_finite_instance(chain) is False
