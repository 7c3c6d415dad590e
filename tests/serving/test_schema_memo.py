"""The per-schema memo on the hit path (gateway/serving/schema_memo.py): a hit gives exactly what
computing gives, per tenant, for the exact schema (key order and number types count), within its
byte bound, and a failure is never remembered."""

from __future__ import annotations

import json
from typing import Any

import pytest

from adapters.base import ToolSpec
from adapters.families import get_family
from gateway.serving.grammars import SchemaMemo
from gateway.serving.output_grammar import json_rule, tool_grammar
from tests.conftest import WORKLOADS

pytestmark = pytest.mark.model_free  # no model, no server: in the fast subset


def counted(memo: SchemaMemo, calls: list[str], namespace: str, schema: Any) -> str:
    def compute() -> str:
        calls.append(namespace)
        return json_rule(schema, 64)

    return memo.get("rule:64", namespace, schema, compute)


def test_a_hit_is_what_computing_gives_for_the_same_schema_in_the_same_namespace() -> None:
    memo, calls = SchemaMemo(), []
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 1}, "b": {"type": "string"}}}
    first = counted(memo, calls, "tenant-a", schema)
    assert counted(memo, calls, "tenant-a", json.loads(json.dumps(schema))) == first == json_rule(schema, 64)
    assert calls == ["tenant-a"]
    counted(memo, calls, "tenant-b", schema)  # another tenant computes its own: no timing across tenants
    reordered = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer", "maximum": 1}}}
    retyped = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 1.0}, "b": {"type": "string"}}}
    assert counted(memo, calls, "tenant-a", reordered) == json_rule(reordered, 64) != first  # order is the grammar's
    counted(memo, calls, "tenant-a", retyped)
    assert calls == ["tenant-a", "tenant-b", "tenant-a", "tenant-a"]


def test_the_memo_keeps_to_its_byte_bound_and_never_remembers_a_failure() -> None:
    memo = SchemaMemo(max_bytes=20_000, max_entry_bytes=5_000)
    for n in range(200):
        memo.get("finite", "", {"type": "object", "description": "x" * n}, lambda: True)
        assert memo.num_bytes <= 20_000
    assert 0 < len(memo) < 200
    calls = []
    memo.get("finite", "", {"description": "y" * 6_000}, lambda: calls.append(1) or True)  # over the entry bound
    memo.get("finite", "", {"description": "y" * 6_000}, lambda: calls.append(1) or True)
    assert calls == [1, 1]

    def refuse() -> bool:
        raise ValueError("bad schema")

    for _ in range(2):
        with pytest.raises(ValueError, match="bad schema"):
            memo.get("finite", "", {"type": "bogus"}, refuse)
    assert memo.get("big", "", {"n": 2**70}, lambda: "computed") == "computed"  # orjson cannot key it


def test_a_memoized_tool_grammar_is_the_computed_one() -> None:
    tools = [ToolSpec(t["function"]["name"], t["function"].get("description"), t["function"].get("parameters"))
             for t in json.loads((WORKLOADS / "merchant_100_tools.json").read_text())[:20]]
    syntax = get_family("chatml").call_syntax()
    memo = SchemaMemo()

    def rule(schema: dict[str, Any], max_string: int) -> str:
        return memo.get(f"rule:{max_string}", "", schema, lambda: json_rule(schema, max_string))

    plain = tool_grammar(syntax, tools, mode="required", max_string=100)
    assert tool_grammar(syntax, tools, mode="required", max_string=100, rule=rule) == plain
    assert tool_grammar(syntax, tools, mode="required", max_string=100, rule=rule) == plain  # from the memo
    assert len(memo) == len({json.dumps(t.parameters) for t in tools})
