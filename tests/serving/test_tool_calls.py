"""Tool calls as an OpenAI client receives them, per family, from a scripted tiny model that writes
exactly what a trained model would: several calls, text then a call, a broken call."""

from __future__ import annotations

import json
from typing import Any

import pytest

from adapters.base import ChatMessage, ToolCallIn
from adapters.families import get_family
from tests.serving.wire import assemble, parse_failures, post, stream
from tests.support.family_models import SETUPS, script

TOOLS = [
    {"type": "function", "function": {"name": "get_order_details", "description": "Get an order.",
                                      "parameters": {"type": "object", "properties": {
                                          "order_id": {"type": "string"}}, "required": ["order_id"]}}},
    {"type": "function", "function": {"name": "get_user_details", "description": "Get a user.",
                                      "parameters": {"type": "object", "properties": {
                                          "user_id": {"type": "string"}}, "required": ["user_id"]}}},
]
CALLS = [("get_order_details", {"order_id": "#W2378156"}), ("get_user_details", {"user_id": "yusuf_rossi_9620"})]
AUTO_FAMILIES = ["chatml", "chatml-native", "llama3", "mistral"]


def model_writes(setup: str, calls: list[tuple[str, dict[str, Any]]], text: str | None = None) -> str:
    """What a model of this family writes for `calls` (after `text`)."""
    turn = ChatMessage("assistant", None, tuple(ToolCallIn("", n, json.dumps(a)) for n, a in calls))
    written = get_family(SETUPS[setup].family).assistant_text(turn)
    return f"{text}\n{written}" if text else written


def body(reply: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "You are a retail agent."},
                         {"role": "user", "content": script(reply)}],
            "tools": TOOLS, "temperature": 0, "max_tokens": 200, **extra}


def assert_openai_calls(calls: list[dict[str, Any]], expected: list[tuple[str, dict[str, Any]]]) -> None:
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert isinstance(call["function"]["arguments"], str)
    assert len({c["id"] for c in calls}) == len(calls)


@pytest.mark.parametrize("setup", AUTO_FAMILIES)
def test_several_calls_come_back_as_tool_calls_with_null_content(family_server, setup, openai_schema):
    resp = post(family_server(setup, scripted=True), body(model_writes(setup, CALLS)))
    openai_schema("CreateChatCompletionResponse", resp)
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert_openai_calls(choice["message"]["tool_calls"], CALLS)


@pytest.mark.parametrize("setup", AUTO_FAMILIES)
def test_streamed_calls_follow_the_openai_delta_protocol(family_server, setup, openai_schema):
    live = family_server(setup, scripted=True)
    chunks = stream(live, body(model_writes(setup, CALLS)))
    for chunk in chunks:
        openai_schema("CreateChatCompletionStreamResponse", chunk)
    seen: set[int] = set()
    for part in (p for c in chunks for ch in c["choices"] for p in ch["delta"].get("tool_calls") or ()):
        if part["index"] not in seen:  # the first delta of a call: everything but the arguments
            seen.add(part["index"])
            assert set(part) == {"index", "id", "type", "function"} and part["function"]["arguments"] == ""
            assert part["id"].startswith("call_") and part["type"] == "function" and part["function"]["name"]
        else:  # later deltas: only argument fragments, the name never again
            assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
    content, calls, finish = assemble(chunks)
    whole = post(live, body(model_writes(setup, CALLS)))["choices"][0]
    assert (content, finish) == (None, "tool_calls") == (whole["message"]["content"], whole["finish_reason"])
    assert_openai_calls(calls, CALLS)
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["tool_calls"]


def test_text_before_a_call_is_content(family_server):
    live = family_server("chatml", scripted=True)
    reply = model_writes("chatml", CALLS[:1], text="Let me look that order up.")
    message = post(live, body(reply))["choices"][0]["message"]
    assert message["content"] == "Let me look that order up."
    assert_openai_calls(message["tool_calls"], CALLS[:1])
    content, calls, _ = assemble(stream(live, body(reply)))
    assert content == message["content"]
    assert_openai_calls(calls, CALLS[:1])


@pytest.mark.parametrize("setup", ["chatml", "llama3"])
def test_a_call_cut_off_by_max_tokens_is_the_call_so_far_with_finish_length(family_server, setup):
    """As OpenAI answers: the call with the arguments written so far, finish `length`; streamed
    the same; counted as a call that did not complete."""
    live = family_server(setup, scripted=True)
    written = model_writes(setup, CALLS[:1])
    before = parse_failures(live)
    request = {**body(written), "max_tokens": 22}  # inside the arguments in both families
    choice = post(live, request)["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_order_details"
    assert '{"order_id": "#W2378156"}'.startswith(call["function"]["arguments"])
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    content, calls, finish = assemble(stream(live, request))
    assert (content, [c["function"] for c in calls], finish) == (None, [call["function"]], "length")
    assert parse_failures(live) == before + 2


@pytest.mark.parametrize("setup", ["chatml", "llama3"])
def test_a_model_that_leaves_the_call_syntax_is_held_to_it(family_server, setup):
    """The model tries to write invalid JSON inside a call; the grammar allows only valid JSON, so
    what comes back never leaks call markup into content."""
    live = family_server(setup, scripted=True)
    broken = model_writes(setup, CALLS[:1]).replace('"#W2378156"', "#W2378156")  # invalid JSON
    choice = post(live, {**body(broken), "max_tokens": 40})["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_order_details" and choice["message"]["content"] is None
    assert call["function"]["arguments"].startswith('{"order_id": "')


@pytest.mark.parametrize("setup", ["chatml", "llama3"])
def test_parallel_tool_calls_false_returns_at_most_one_call(family_server, setup):
    live = family_server(setup, scripted=True)
    request = body(model_writes(setup, CALLS), parallel_tool_calls=False)
    message = post(live, request)["choices"][0]["message"]
    assert_openai_calls(message["tool_calls"], CALLS[:1])
    _, calls, finish = assemble(stream(live, request))
    assert finish == "tool_calls"
    assert_openai_calls(calls, CALLS[:1])


def test_tool_choice_none_returns_call_syntax_as_plain_text(family_server):
    reply = model_writes("chatml", CALLS[:1])
    message = post(family_server("chatml", scripted=True), body(reply, tool_choice="none"))["choices"][0]["message"]
    assert message["content"] == reply and "tool_calls" not in message
