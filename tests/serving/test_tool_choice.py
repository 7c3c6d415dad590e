"""tool_choice and parallel_tool_calls on tiny random-weight models of each family. A random model
writes noise, so these assert what the grammar makes certain: a call of a listed (or the named)
tool, and a function without arguments is forced whole."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.serving.wire import assemble, post, stream
from tests.support.family_models import SETUPS

FAMILIES = list(SETUPS)
LIST_TYPES = {"type": "function", "function": {
    "name": "list_all_product_types", "description": "List the name and product id of all product types.",
    "parameters": {"type": "object", "properties": {}, "required": []}}}
GET_ORDER = {"type": "function", "function": {
    "name": "get_order_details", "description": "Get the status and details of an order.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}
CANCEL = {"type": "function", "function": {
    "name": "cancel_pending_order", "description": "Cancel a pending order.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"},
                                                   "reason": {"type": "string"}}}}}
TOOLS = [GET_ORDER, LIST_TYPES, CANCEL]


def body(question: str = "What do you sell?", tools: list[dict[str, Any]] = TOOLS, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "You are the shop's retail agent. Use the tools."},
                         {"role": "user", "content": question}],
            "tools": tools, "temperature": 0, "max_tokens": 6, **extra}


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize("setup", FAMILIES)
def test_tool_choice_none_makes_no_call_and_keeps_the_tools_in_the_cached_prefix(family_server, setup):
    live = family_server(setup)
    auto = post(live, body("First question?", tool_choice="auto"))
    none = post(live, body("Second question?", tool_choice="none"))
    assert "tool_calls" not in none["choices"][0]["message"]
    assert none["choices"][0]["finish_reason"] in ("stop", "length")
    assert none["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the entry `auto` made
    assert auto["usage"]["prompt_tokens"] - auto["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("setup", FAMILIES)
@pytest.mark.parametrize("choice", [named("list_all_product_types"), "required"])
def test_a_function_without_arguments_is_forced_whole(family_server, setup, choice, openai_schema):
    """Named (or `required` with one tool) and taking no arguments: the whole call is forced, and
    with parallel_tool_calls false nothing may follow it, so the model generates nothing."""
    live = family_server(setup)
    tools = TOOLS if choice != "required" else [LIST_TYPES]
    request = body(tools=tools, tool_choice=choice, parallel_tool_calls=False)
    resp = post(live, request)
    openai_schema("CreateChatCompletionResponse", resp)
    choice0 = resp["choices"][0]
    assert choice0["finish_reason"] == "tool_calls" and choice0["message"]["content"] is None
    [call] = choice0["message"]["tool_calls"]
    assert call["function"] == {"name": "list_all_product_types", "arguments": "{}"}
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert resp["usage"]["completion_tokens"] == 0
    content, calls, finish = assemble(stream(live, request))
    assert (content, finish) == (None, "tool_calls")
    assert [c["function"] for c in calls] == [call["function"]]


@pytest.mark.parametrize("setup", FAMILIES)
def test_named_tool_choice_always_gives_a_call_of_that_tool(family_server, setup):
    """Random weights write noise, and the grammar still holds it to a call of the named tool whose
    arguments so far are a prefix of valid JSON; 6 tokens cut it off: finish `length`, as OpenAI."""
    live = family_server(setup)
    request = body("Where is order #W1?", tool_choice=named("get_order_details"))
    choice = post(live, request)["choices"][0]
    message = choice["message"]
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_order_details"
    assert call["function"]["arguments"].startswith("{")
    assert choice["finish_reason"] == "length"
    content, calls, finish = assemble(stream(live, request))  # streamed, the same answer
    assert (content, finish) == (None, "length")
    assert [c["function"] for c in calls] == [call["function"]]


@pytest.mark.parametrize("setup", FAMILIES)
def test_required_gives_a_call_to_a_listed_tool(family_server, setup):
    live = family_server(setup)
    message = post(live, body("Cancel order #W1", tool_choice="required", max_tokens=40))["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] in {t["function"]["name"] for t in TOOLS}


@pytest.mark.parametrize("setup", FAMILIES)
@pytest.mark.parametrize("choice", [named("get_order_details"), "required"])
def test_stop_sequences_never_cut_a_forced_call(family_server, setup, choice):
    """A stop sequence that occurs inside the call (a quote, a brace, the argument's name) does not
    cut it: the answer is the one without stop sequences. Before, the call was cut mid-arguments
    (`"arguments": "{"`) and still reported as a finished call."""
    live = family_server(setup)
    plain = body("Where is order #W1?", tool_choice=choice, max_tokens=12)
    stopped = dict(plain, stop=['"', "{", "order_id", ":"])
    assert calls_of(post(live, stopped)) == calls_of(post(live, plain))
    content, calls, finish = assemble(stream(live, stopped))
    assert (content, [c["function"] for c in calls], finish) == calls_of(post(live, plain))


def calls_of(resp: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]], str]:
    """(content, each call's function, finish_reason): an answer but for its call ids."""
    choice = resp["choices"][0]
    calls = [c["function"] for c in choice["message"].get("tool_calls") or ()]
    return choice["message"]["content"], calls, choice["finish_reason"]


def test_forcing_a_call_still_hits_the_tool_group_prefix(family_server):
    live = family_server("chatml")
    post(live, body("Warm the cache", tool_choice="auto"))
    forced = post(live, body("Now forced", tool_choice=named("get_order_details")))
    whole = post(live, body("Now whole", tool_choice=named("list_all_product_types")))
    assert forced["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        forced["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [GET_ORDER], "tool_choice": named("list_all_product_types")}, "tool_choice"),
    ({"tools": [GET_ORDER], "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": [GET_ORDER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "sometimes",
                                                                                       "tools": [named("x")]}}},
     "tool_choice.allowed_tools.mode"),
])
def test_a_tool_choice_that_cannot_be_honoured_is_a_400(family_server, extra, param):
    request = {"messages": [{"role": "user", "content": "hi"}], **extra}
    resp = httpx.post(family_server("chatml").api_url + "/chat/completions", json=request, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
