"""tool_choice and parallel_tool_calls on tiny random-weight models of each family. A random model
writes noise, so these assert what the forcing makes certain: the call's opening (with its name)
is in place, and a function without arguments is forced whole."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from adapters.families import get_family
from tests.tools.models import SETUPS
from tests.tools.wire import assemble, post, stream

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
def test_named_tool_choice_forces_the_opening_with_its_name(family_server, setup):
    live = family_server(setup)
    request = body("Where is order #W1?", tool_choice=named("get_order_details"))
    message = post(live, request)["choices"][0]["message"]
    opening = get_family(SETUPS[setup].family).call_opening("get_order_details")
    if message.get("tool_calls"):  # the noise happened to complete the call
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_order_details"]
    else:  # it did not parse: the raw output, forced opening included, is the content
        assert message["content"].startswith(opening.strip())
    content, calls, _ = assemble(stream(live, request))  # streamed, the same answer
    assert content == (message["content"] or None)
    assert [c["function"] for c in calls] == [c["function"] for c in message.get("tool_calls") or ()]


@pytest.mark.parametrize("setup", FAMILIES)
def test_required_forces_the_opening_of_a_call(family_server, setup):
    live = family_server(setup)
    message = post(live, body("Cancel order #W1", tool_choice="required"))["choices"][0]["message"]
    opening = get_family(SETUPS[setup].family).call_opening(None)
    assert message.get("tool_calls") or message["content"].startswith(opening.strip())


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
    ({"tools": [GET_ORDER], "tool_choice": {"type": "function"}}, "tool_choice"),
])
def test_a_tool_choice_that_cannot_be_honoured_is_a_400(family_server, extra, param):
    request = {"messages": [{"role": "user", "content": "hi"}], **extra}
    resp = httpx.post(family_server("chatml").api_url + "/chat/completions", json=request, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
