"""The constrained scenario end to end through `toolkv bench` against a tiny random-weight model:
with the schemas bounded (a random model writes until max_tokens inside any open string), every
forced call, streamed or not, and every structured answer is valid, and the grammar's cost per
token is read from /metrics. Then the rows, the checks and the bounds on their own."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.bench.bfcl import MERCHANT_SLICE, SCHEMA_ROWS, load_tool_rows, quick
from gateway.bench.lab.constrained import BOUND_CHARS, bounded_schema, grammar_cost, load_rows, request_body
from gateway.bench.lab.targets import targets
from gateway.bench.lab.validity import Answer, StreamAssembler, answer_problem, call_problem
from gateway.cli.main import main
from gateway.settings import load_settings
from tests.support.server import LiveServer, serve

TOOL_KINDS = ["required", "named", "required-stream", "named-stream"]
SCHEMA_KINDS = ["json_schema", "json_schema-stream"]


@pytest.fixture(scope="module")
def long_context(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A tiny model with the default model's context: the airline rows hold ~4,500 tokens."""
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama", context=8192)), "min_prefix_tokens": 8,
                                        "served_model_name": "tiny-llama",
                                        "cache_dir": str(tmp_path_factory.mktemp("cache"))}, environ={})
    with serve(settings) as server:
        yield server


@pytest.fixture(scope="module")
def constrained(long_context: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("constrained-out")
    code = main(["bench", "--base-url", long_context.base_url, "--lab", "--scenario", "constrained", "--quick",
                 "--bounded", "--no-floor", "--out", str(out)])
    assert code == 0
    return dict(json.loads((out / "bench.json").read_text()))


def test_every_forced_call_and_structured_answer_is_valid_on_a_tiny_model(constrained):
    c = constrained["scenarios"]["constrained"]
    assert c["skipped"] is None and c["failures"] == []
    assert list(c["by_kind"]) == TOOL_KINDS + SCHEMA_KINDS
    assert c["requests"] == 5 * 4 + 4 * 2 and c["beyond_context"] == 0
    assert c["valid"] == c["requests"] and c["all_valid"] is True
    for kind in TOOL_KINDS:
        assert c["by_kind"][kind]["finish_reasons"] == {"tool_calls": 5}
    for kind in SCHEMA_KINDS:
        assert c["by_kind"][kind]["finish_reasons"] == {"stop": 4}
    assert constrained["targets"]["constrained_all_valid"] is True


def test_named_calls_call_the_rows_tool(constrained):
    by_kind = constrained["scenarios"]["constrained"]["by_kind"]
    assert by_kind["named"]["tool_accuracy"]["share"] == by_kind["named-stream"]["tool_accuracy"]["share"] == 1.0
    assert set(by_kind["required"]["by_catalog"]) == {"merchant", "retail", "airline"}


def test_grammar_cost_per_token_is_read_from_the_servers_counters(constrained):
    c = constrained["scenarios"]["constrained"]
    cost = c["cost"]["all"]
    assert cost["constrained_tokens"] >= sum(s["completion_tokens"] for s in c["samples"]) > 0
    assert cost["decode_steps"] > 0 and cost["grammar_ms_per_token"] > 0 and cost["decode_ms_per_step"] > 0
    assert cost["grammar_share_of_decode"] == pytest.approx(
        cost["grammar_ms_per_token"] / cost["decode_ms_per_step"], rel=0.01)
    assert all(c["cost"][kind]["constrained_tokens"] > 0 for kind in TOOL_KINDS + SCHEMA_KINDS)
    assert constrained["targets"]["constraint_cost_at_most_10pct_of_decode"] in (True, False)


def test_report_lists_the_rows_it_sent(constrained):
    c = constrained["scenarios"]["constrained"]
    assert [r["catalog"] for r in c["rows"]] == ["merchant", "merchant", "retail", "retail", "airline"]
    assert all(r["source"] and r["question"] and r["expected_tool"] for r in c["rows"])
    assert {r["shape"] for r in c["schema_rows"]} == {"enum", "nested", "array", "integer-range"}
    assert c["max_tokens"] == 512 and c["bounded"] is True


def test_rows_span_the_three_catalogs_each_expecting_a_tool_it_lists():
    rows = load_tool_rows()
    assert 30 <= len(rows) <= 64 and len({r.id for r in rows}) == len(rows)
    assert {r.catalog for r in rows} == {"merchant", "retail", "airline"}
    for row in rows:
        assert row.tool(row.expected_tool) is not None
        assert row.messages[-1]["role"] == "user" and row.messages[-1]["content"]
    merchant = [r for r in rows if r.catalog == "merchant"]
    assert all(len(r.tools) == MERCHANT_SLICE and r.offset % MERCHANT_SLICE == 0 for r in merchant)
    assert len({r.offset for r in merchant}) == 5  # every slice of the catalog is asked about


def test_airline_rows_end_where_the_recorded_agent_first_called_a_tool():
    row = next(r for r in load_tool_rows() if r.id == "airline-10")
    assert row.expected_tool == "get_reservation_details"
    assert "H9ZU1C" in row.messages[-1]["content"]  # the id the call needs is in the turns sent
    assert all(m["role"] in ("user", "assistant") for m in row.messages)


def test_quick_set_is_a_row_of_each_catalog_and_a_schema_of_each_shape():
    tools, schemas = quick(load_tool_rows(), SCHEMA_ROWS)
    assert {r.catalog for r in tools} == {"merchant", "retail", "airline"} and len(tools) == 5
    assert {r.shape for r in schemas} == {"enum", "nested", "array", "integer-range", "json_object"}


def test_bounded_rows_drop_json_object_and_send_one_call_per_answer():
    rows = load_rows(quick_set=True, bounded=True)
    assert all(r.schema is not None for r in rows.schemas) and rows.num_requests == 5 * 4 + 4 * 2
    body = request_body("named-stream", rows.tools[0], model="m", max_tokens=64, bounded=True)
    assert body["parallel_tool_calls"] is False and body["stream"] is True
    assert body["tool_choice"] == {"type": "function", "function": {"name": rows.tools[0].expected_tool}}
    assert "parallel_tool_calls" not in request_body("required", rows.tools[0], model="m", max_tokens=64,
                                                     bounded=False)


def test_bounded_schema_bounds_open_strings_lists_and_numbers_only():
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "cabin": {"type": "string", "enum": ["economy", "business"]},
        "ids": {"type": "array", "items": {"type": "string"}},
        "amount": {"type": "number"}, "nights": {"type": "integer", "minimum": 1, "maximum": 30}}}
    props = bounded_schema(schema)["properties"]
    assert props["name"] == {"type": "string", "maxLength": BOUND_CHARS}
    assert props["zip"] == schema["properties"]["zip"] and props["cabin"] == schema["properties"]["cabin"]
    assert props["ids"]["maxItems"] == 2 and props["ids"]["items"]["maxLength"] == BOUND_CHARS
    assert props["amount"] == {"type": "integer", "minimum": 0, "maximum": 99}
    assert props["nights"] == {"type": "integer", "minimum": 1, "maximum": 30}


TOOLS = {"get_order": {"type": "function", "function": {"name": "get_order", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}},
    "ping": {"type": "function", "function": {"name": "ping"}}}


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_streamed_deltas_are_assembled_as_the_openai_sdk_does():
    assembler = StreamAssembler()
    for delta in ({"role": "assistant", "content": ""},
                  {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                   "function": {"name": "get_order", "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '{"order_id": '}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '"#W1"}'}}]}):
        assembler.feed({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    assembler.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    answer = assembler.answer()
    assert answer.calls == ({"index": 0, **_call("get_order", '{"order_id": "#W1"}')},) and answer.content == ""
    assert call_problem(answer, TOOLS, "get_order") is None


@pytest.mark.parametrize("answer, named, problem", [
    (Answer(None, (_call("get_order", '{"order_id": "#W1"}'),), "length"), None, "cut by max_tokens"),
    (Answer("Paris", (), "stop"), None, "no tool call"),
    (Answer(None, (_call("Paris", "{}"),), "tool_calls"), None, "not a listed tool"),
    (Answer(None, (_call("ping", "{}"),), "tool_calls"), "get_order", "not the named tool"),
    (Answer(None, (_call("get_order", '{"city_target": "Paris"}'),), "tool_calls"), None, "not valid for the schema"),
    (Answer(None, (_call("get_order", '{"order_id": '),), "tool_calls"), None, "not JSON"),
    (Answer("</tool_call>", (_call("ping", "{}"),), "tool_calls"), None, "markup"),
])
def test_a_forced_call_is_invalid_for_what_a_client_would_trip_on(answer, named, problem):
    assert problem in (call_problem(answer, TOOLS, named) or "")


def test_structured_answers_must_parse_and_validate():
    schema = {"type": "object", "properties": {"rating": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["rating"]}
    assert answer_problem(Answer('{"rating": 4}', (), "stop"), schema) is None
    assert "not valid for the schema at /rating" in (answer_problem(Answer('{"rating": 9}', (), "stop"), schema) or "")
    assert "not JSON" in (answer_problem(Answer("Four stars", (), "stop"), schema) or "")
    assert answer_problem(Answer("[1]", (), "stop"), None) is not None  # json_object: an object
    assert "cut by max_tokens" in (answer_problem(Answer('{"rating": 4}', (), "length"), schema) or "")


def test_grammar_cost_is_the_counters_growth_per_token_and_per_step():
    before = {"toolkv_constrained_tokens_total": 10.0, "toolkv_constraint_seconds_total": 0.01,
              "toolkv_decode_steps_total": 10.0, "toolkv_decode_seconds_total": 0.5}
    after = {"toolkv_constrained_tokens_total": 110.0, "toolkv_constraint_seconds_total": 0.21,
             "toolkv_decode_steps_total": 110.0, "toolkv_decode_seconds_total": 5.5}
    cost = grammar_cost(before, after)
    assert (cost["grammar_ms_per_token"], cost["decode_ms_per_step"]) == (2.0, 50.0)
    assert cost["grammar_share_of_decode"] == 0.04
    assert grammar_cost({}, {})["grammar_share_of_decode"] is None  # a server without the counters


def constrained_targets(constrained: dict[str, Any]) -> dict[str, bool | None]:
    met = targets({"scenarios": {"constrained": constrained}})
    return {k: met[k] for k in ("constrained_all_valid", "constraint_cost_at_most_10pct_of_decode")}


def test_targets_are_every_answer_valid_and_the_grammar_within_a_tenth_of_decode():
    measured = {"requests": 8, "all_valid": True, "cost": {"all": {"grammar_share_of_decode": 0.04}}}
    assert constrained_targets(measured) == {"constrained_all_valid": True,
                                             "constraint_cost_at_most_10pct_of_decode": True}
    slow = {"requests": 8, "all_valid": False, "cost": {"all": {"grammar_share_of_decode": 0.12}}}
    assert constrained_targets(slow) == {"constrained_all_valid": False,
                                         "constraint_cost_at_most_10pct_of_decode": False}
    assert set(constrained_targets({}).values()) == {None}
