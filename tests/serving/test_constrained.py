"""Constrained decoding over HTTP, on tiny random-weight models of each family: random weights
write noise, so whatever comes back valid was made valid by the grammar. Schemas bound their
values (enums, ranges, short strings) so that noise ends within max_tokens."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from tests.serving.wire import assemble, post, stream
from tests.support.family_models import SETUPS

FAMILIES = list(SETUPS)
BOUNDED = {"type": "object", "properties": {
    "order_id": {"type": "string", "maxLength": 6},
    "reason": {"enum": ["no longer needed", "ordered by mistake"]},
    "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
    "gift": {"type": "boolean"}}, "required": ["order_id", "reason", "quantity", "gift"]}
TOOLS = [
    {"type": "function", "function": {"name": "cancel_pending_order", "description": "Cancel an order.",
                                      "parameters": BOUNDED, "strict": True}},
    {"type": "function", "function": {"name": "get_order_details", "description": "Get an order.",
                                      "parameters": {"type": "object", "properties": {
                                          "order_id": {"type": "string", "maxLength": 6}},
                                          "required": ["order_id"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ANSWER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Lyon", "Nice"]}, "days": {"type": "integer", "minimum": 1, "maximum": 30},
    "tags": {"type": "array", "items": {"enum": ["food", "art"]}, "maxItems": 2}},
    "required": ["city", "days", "tags"]}


def chat(question: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "You are the shop's retail agent."},
                         {"role": "user", "content": question}],
            "temperature": 0, "max_tokens": 120, **extra}


def structured(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def valid_calls(calls: list[dict[str, Any]], names: set[str]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for call in calls:
        name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
        assert name in names
        jsonschema.validate(args, SCHEMAS[name])
        out.append((name, args))
    return out


@pytest.mark.parametrize("setup", FAMILIES)
def test_required_gives_schema_valid_calls_whole_and_streamed(family_server, setup, openai_schema):
    live = family_server(setup)
    request = chat("Cancel order W1, I ordered it by mistake.", tools=TOOLS, tool_choice="required",
                   parallel_tool_calls=False)
    resp = post(live, request)
    openai_schema("CreateChatCompletionResponse", resp)
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    whole = valid_calls(choice["message"]["tool_calls"], set(SCHEMAS))
    chunks = stream(live, request)
    for chunk in chunks:
        openai_schema("CreateChatCompletionStreamResponse", chunk)
    content, calls, finish = assemble(chunks)
    assert (content, finish) == (None, "tool_calls")
    assert valid_calls(calls, set(SCHEMAS)) == whole


@pytest.mark.parametrize("setup", FAMILIES)
def test_parallel_calls_are_each_valid(family_server, setup):
    """Greedy noise may repeat calls until max_tokens: every call it completed is valid, and a
    cut-off last call is the arguments so far, as OpenAI returns it (finish `length`)."""
    live = family_server(setup)
    choice = post(live, chat("Cancel orders W1 and W2.", tools=TOOLS, tool_choice="required"))["choices"][0]
    calls = choice["message"]["tool_calls"]
    complete = calls if choice["finish_reason"] == "tool_calls" else calls[:-1]
    assert choice["finish_reason"] in ("tool_calls", "length") and calls
    valid_calls(complete, set(SCHEMAS))


@pytest.mark.parametrize("setup", FAMILIES)
def test_a_named_function_gives_one_valid_call_of_it(family_server, setup):
    live = family_server(setup)
    request = chat("Where is my order?", tools=TOOLS, parallel_tool_calls=True,
                   tool_choice={"type": "function", "function": {"name": "cancel_pending_order"}})
    choice = post(live, request)["choices"][0]
    assert [n for n, _ in valid_calls(choice["message"]["tool_calls"], {"cancel_pending_order"})] == \
        ["cancel_pending_order"]
    assert choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("setup", FAMILIES)
def test_response_format_json_schema_gives_valid_json_whole_and_streamed(family_server, setup, openai_schema):
    live = family_server(setup)
    request = chat("Plan a trip.", response_format=structured(ANSWER))
    resp = post(live, request)
    openai_schema("CreateChatCompletionResponse", resp)
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), ANSWER)
    content, calls, finish = assemble(stream(live, request))
    assert (content, calls, finish) == (choice["message"]["content"], [], "stop")


def test_json_object_gives_a_json_object(family_server):
    """Scripted to write a JSON object: it comes back as written (the grammar allowed every token)."""
    from tests.support.family_models import script

    live = family_server("chatml", scripted=True)
    written = '{"city": "Paris", "days": 3}'
    request = {"messages": [{"role": "user", "content": script(written)}], "temperature": 0, "max_tokens": 60,
               "response_format": {"type": "json_object"}}
    assert json.loads(post(live, request)["choices"][0]["message"]["content"]) == {"city": "Paris", "days": 3}


def test_auto_with_response_format_answers_with_the_schema_or_calls(family_server):
    live = family_server("chatml")
    choice = post(live, chat("Plan a trip.", tools=TOOLS, tool_choice="auto",
                             response_format=structured(ANSWER)))["choices"][0]
    if choice["message"].get("tool_calls"):
        valid_calls(choice["message"]["tool_calls"], set(SCHEMAS))
    else:
        jsonschema.validate(json.loads(choice["message"]["content"]), ANSWER)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "cancel_pending_order"}}])
def test_the_cache_never_changes_a_constrained_output(family_server, choice):
    """A miss (compiles the group), a hit, and a bypass give the same calls with the grammar on."""
    live = family_server("chatml-native")
    request = chat(f"Cancel my order ({json.dumps(choice)[:20]}).", tools=TOOLS, tool_choice=choice)
    requests = [post(live, request), post(live, request), post(live, request, headers={"X-Toolkv-Cache": "bypass"})]
    details = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in requests]
    assert details[1] > 0 and details[2] == 0
    calls = [[c["function"] for c in r["choices"][0]["message"]["tool_calls"]] for r in requests]
    assert calls[0] == calls[1] == calls[2]


def test_the_cache_never_changes_a_structured_answer(family_server):
    live = family_server("llama3")
    request = chat("Plan a trip to the coast.", tools=TOOLS, tool_choice="none", response_format=structured(ANSWER))
    outputs = [post(live, request, headers=h)["choices"][0]["message"]["content"]
               for h in (None, None, {"X-Toolkv-Cache": "bypass"})]
    assert outputs[0] == outputs[1] == outputs[2]
    jsonschema.validate(json.loads(outputs[0]), ANSWER)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": structured({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})},
     "response_format"),
    ({"tools": [TOOLS[1], {"type": "function", "function": {
        "name": "broken", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}}]},
     "tools[1].function.parameters"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_a_schema_that_cannot_be_enforced_is_a_400_naming_it(family_server, extra, param):
    resp = httpx.post(family_server("chatml").api_url + "/chat/completions",
                      json={**chat("hi"), **extra}, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] is not None and error["param"].startswith(param.split(".")[0])


OPEN_ENDED = {"type": "function", "function": {
    "name": "send_note", "description": "Send a note.",
    "parameters": {"type": "object", "properties": {"to": {"type": "string"}, "body": {"type": "string"},
                                                   "tags": {"type": "array", "items": {"type": "string"}}},
                   "required": ["to", "body", "tags"]}}}


@pytest.mark.parametrize("setup", ["chatml", "llama3", "mistral"])
def test_a_call_near_max_tokens_is_steered_to_a_valid_end(family_server, setup):
    """Noise inside open-ended strings and arrays would run past max_tokens; the last quarter of the
    budget (at most `constrained_reserve_tokens`) keeps only tokens that end something, so the call
    ends valid within max_tokens instead of being cut off."""
    live = family_server(setup)
    choice = post(live, chat("Send a note to Ann.", tools=[OPEN_ENDED], max_tokens=80,
                             tool_choice={"type": "function", "function": {"name": "send_note"}}))["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(call["function"]["arguments"]), OPEN_ENDED["function"]["parameters"])
