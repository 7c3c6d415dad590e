"""Anthropic's Messages API (`POST /v1/messages`) as the real `anthropic` SDK sees it: a whole
message and a streamed one (the SDK's `messages.stream` accumulates the same message), Anthropic's
SSE event names and order, a forced tool_use whose input is valid for its schema, usage that splits
the prompt into cache reads, cache writes and the rest (shared with the equivalent chat request),
tool_use / tool_result turns, `x-api-key`, and errors in Anthropic's envelope raised as the SDK's
typed exceptions. Text and calls a test must predict come from the scripted model."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.api.app import create_app
from gateway.settings import load_settings
from tests.api.conftest import RESPONSES_KEYS
from tests.clients.scenario import ORDER_ARGS, ORDER_ID, hermes_calls, tool_result
from tests.support.family_models import script, scripted_runtime
from tests.support.server import serve_app

MODEL = "tiny-llama"
SYSTEM = "You are a merchant assistant."
BOUNDED = {"type": "object", "properties": {
    "order_id": {"type": "string", "maxLength": 6},
    "reason": {"enum": ["no longer needed", "ordered by mistake"]},
    "quantity": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["order_id", "reason", "quantity"]}
CANCEL_TOOL = {"name": "cancel_pending_order", "description": "Cancel a pending order.", "input_schema": BOUNDED}
ORDER_TOOL = {"name": "get_order_details", "description": "Get the details of an order.",
              "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"}},
                               "required": ["order_id"], "additionalProperties": False}}
GREEDY = {"temperature": 0}  # the SDK (2.x) has no sampling arguments; older clients send them
EVENT_ORDER = ("message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
               "message_delta", "message_stop")


def anthropic_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat-shaped tools as Anthropic's."""
    return [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
             "input_schema": t["function"].get("parameters") or {"type": "object"}} for t in tools]


def ask(question: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": question}]


def sdk(live, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.base_url, api_key=key, max_retries=0)


def sse(live, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The stream's (event name, data) pairs."""
    with httpx.stream("POST", live.api_url + "/messages", json={**body, "stream": True}, timeout=60,
                      headers={"anthropic-version": "2023-06-01"}) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line for line in resp.iter_lines() if line.startswith(("event: ", "data: "))]
    return [(name[len("event: "):], json.loads(data[len("data: "):])) for name, data in zip(lines[0::2], lines[1::2],
                                                                                           strict=True)]


@pytest.fixture
def client(live) -> anthropic.Anthropic:
    return sdk(live)


# ---- the random-weight model -------------------------------------------------------------------


def test_a_whole_answer_is_an_anthropic_message(client):
    message = client.messages.create(model=MODEL, max_tokens=6, system=SYSTEM, messages=ask("What was GMV?"),
                                     extra_body=GREEDY, metadata={"user_id": "u-1"})
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL and message.stop_reason in ("end_turn", "max_tokens")
    assert message.stop_sequence is None
    assert all(block.type == "text" and block.text for block in message.content)
    usage = message.usage
    assert 0 < usage.output_tokens <= 6 and usage.input_tokens > 0
    if message.stop_reason == "max_tokens":  # random weights rarely end on their own
        assert usage.output_tokens == 6


def test_the_sdk_stream_accumulates_the_whole_answers_message(client):
    args = dict(model=MODEL, max_tokens=8, system=[{"type": "text", "text": SYSTEM}],
                messages=ask("Refund rate?"), extra_body=GREEDY)
    whole = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.id.startswith("msg_") and final.id != whole.id
    assert [b.model_dump(exclude_none=True) for b in final.content] == [b.model_dump(exclude_none=True)
                                                                         for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    total = whole.usage.input_tokens + whole.usage.cache_read_input_tokens + whole.usage.cache_creation_input_tokens
    assert total == (final.usage.input_tokens + final.usage.cache_read_input_tokens
                     + final.usage.cache_creation_input_tokens)


def test_stream_events_come_in_anthropics_order_and_names(live):
    events = sse(live, {"model": MODEL, "max_tokens": 6, "messages": ask("Orders today?"), "temperature": 0})
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert [EVENT_ORDER.index(name) for name in names] == sorted(EVENT_ORDER.index(name) for name in names)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens") and delta["usage"]["output_tokens"] > 0
    assert delta["usage"]["input_tokens"] == start["usage"]["input_tokens"]


def test_a_forced_tool_use_has_input_valid_for_its_schema_whole_and_streamed(client):
    args = dict(model=MODEL, max_tokens=60, system=SYSTEM, messages=ask("Cancel order W1."), extra_body=GREEDY,
                tools=[ORDER_TOOL, CANCEL_TOOL], tool_choice={"type": "tool", "name": "cancel_pending_order"})
    whole = client.messages.create(**args)
    assert whole.stop_reason == "tool_use"
    calls = [block for block in whole.content if block.type == "tool_use"]
    assert [call.name for call in calls] == ["cancel_pending_order"]
    assert calls[0].id.startswith("toolu_")
    jsonschema.validate(calls[0].input, BOUNDED)
    with client.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(calls[0].name, calls[0].input)]


def test_usage_counts_cache_writes_then_reads_and_the_chat_request_shares_them(live, client, merchant_tools):
    tools = merchant_tools[40:45]
    args = dict(model=MODEL, max_tokens=3, system=SYSTEM, tools=anthropic_tools(tools),
                tool_choice={"type": "none"}, extra_body=GREEDY)
    first = client.messages.with_raw_response.create(messages=ask("GMV?"), **args)
    second = client.messages.with_raw_response.create(messages=ask("Refunds?"), **args)
    assert (first.headers["x-toolkv-cache"], second.headers["x-toolkv-cache"]) == ("miss", "hit")
    cold, warm = first.parse().usage, second.parse().usage
    assert cold.cache_creation_input_tokens > 0 and cold.cache_read_input_tokens == 0 and cold.input_tokens > 0
    assert warm.cache_read_input_tokens > 0 and warm.cache_creation_input_tokens == 0 and warm.input_tokens > 0
    assert warm.cache_read_input_tokens == cold.cache_creation_input_tokens  # the tool group, written then read
    chat = httpx.post(live.api_url + "/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Stock?"}],
        "tools": tools, "tool_choice": "none", "temperature": 0, "max_tokens": 3})
    assert chat.headers["x-toolkv-cache"] == "hit"
    assert chat.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == warm.cache_read_input_tokens


def test_output_config_format_gives_json_valid_for_the_schema(client):
    answer = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    message = client.messages.create(model=MODEL, max_tokens=40, messages=ask("Plan a trip."), extra_body=GREEDY,
                                     output_config={"format": {"type": "json_schema", "schema": answer}})
    [block] = message.content
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(block.text), answer)


def test_cache_control_breakpoints_are_accepted(client, merchant_tools):
    tools = anthropic_tools(merchant_tools[50:52])
    tools[-1]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}  # longer TTLs first: tools, system, messages
    marked = {"type": "ephemeral"}
    message = client.messages.create(
        model=MODEL, max_tokens=2, extra_body=GREEDY, tools=tools, cache_control=marked, tool_choice={"type": "auto"},
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": marked}]}])
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"extra_body": {"top_k": 5}}, "'top_k' is not supported"),
    ({"tools": [ORDER_TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "'stop_sequences': Value error, at most 4 stop sequences"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image'"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "count", "input_schema": {"type": "integer"}}]}, "'tools[0].input_schema'"),
    ({"tools": [ORDER_TOOL], "tool_choice": {"type": "tool"}}, "'tool_choice.name': Field required"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]},
     "messages[1]: a final assistant message (prefilling"),
])
def test_a_bad_request_is_anthropics_error_envelope(client, kwargs, words):
    args: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "messages": ask("Hi"), **kwargs}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**args)
    body = caught.value.body
    assert caught.value.status_code == 400 and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == "invalid_request_error"
    assert words in body["error"]["message"]


MARK, HOUR = {"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}


def text(value: str, mark: dict[str, str] | None = None) -> dict[str, Any]:
    return {"type": "text", "text": value, **({"cache_control": mark} if mark else {})}


@pytest.mark.parametrize(("body", "message"), [
    ({"messages": [{"role": "user", "content": [text(str(i), MARK) for i in range(5)]}]},
     "A maximum of 4 blocks with cache_control may be provided. Found 5."),
    ({"messages": [{"role": "user", "content": [text("a", MARK) for _ in range(4)]}], "cache_control": MARK},
     "A maximum of 4 blocks with cache_control may be provided. Found 5."),
    ({"tools": [{**ORDER_TOOL, "cache_control": MARK}], "system": [text("Be brief.", HOUR)], "messages": ask("Hi")},
     "system[0].cache_control.ttl: a ttl='1h' cache_control block must not come after a ttl='5m' cache_control "
     "block. Note that blocks are processed in the following order: `tools`, `system`, `messages`."),
    ({"messages": [{"role": "user", "content": [text("Hi"), text("")]}]},
     "messages[0].content[1].text: text content blocks must contain non-whitespace text"),
    ({"messages": [{"role": "user", "content": [text(" \n")]}]},
     "messages[0].content[0].text: text content blocks must contain non-whitespace text"),
    ({"messages": [{"role": "user", "content": ""}]},
     "messages[0]: all messages must have non-empty content except for the optional final assistant message"),
    ({"messages": ask("Hi"), "stop_sequences": ["END", "\n"]},
     "stop_sequences: each stop sequence must contain non-whitespace"),
])
def test_what_anthropic_refuses_is_refused_in_its_words(live, body, message):
    """Fails on 8363295: each of these was answered as if honoured (issue 36, finding 6)."""
    for path in ("/messages", "/messages/count_tokens"):
        resp = httpx.post(live.api_url + path, json={"model": MODEL, "max_tokens": 4, **body}, timeout=60)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"] == {"type": "invalid_request_error", "message": message}


def test_what_anthropic_accepts_is_served(client):
    """Four breakpoints, longer TTLs first; an assistant turn's blank text (a model may write it)."""
    message = client.messages.create(
        model=MODEL, max_tokens=2, extra_body=GREEDY, tools=[{**ORDER_TOOL, "cache_control": HOUR}],
        system=[text("Be brief.", HOUR)], stop_sequences=["END"],
        messages=[{"role": "user", "content": [text("Hi", MARK)]},
                  {"role": "assistant", "content": [text(" "), {"type": "tool_use", "id": "toolu_1",
                                                                "name": "get_order_details", "input": ORDER_ARGS}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok",
                                                "cache_control": MARK}]}])
    assert message.type == "message"


json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 10**6) | st.text(max_size=12),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=3), max_leaves=12)
blocks = st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result", "image", "x"])},
                               optional={"text": json_values, "id": st.just("t1"), "name": st.just("f"),
                                         "input": json_values, "tool_use_id": st.just("t1"), "content": json_values})
near_valid = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool"]),
                                                 "content": st.text(max_size=20) | st.lists(blocks, max_size=3)}),
                          max_size=3)},
    optional={"max_tokens": st.integers(-1, 3) | json_values, "system": json_values, "stream": st.booleans(),
              "tools": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["f", "g h"]),
                                                       "input_schema": json_values}), max_size=2),
              "tool_choice": json_values | st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool"])},
                                                                 optional={"name": st.just("f")}),
              "stop_sequences": json_values, "temperature": json_values, "top_k": json_values})


@given(body=near_valid)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_near_valid_requests_are_served_or_refused_in_anthropics_envelope(live, body):
    resp = httpx.post(live.api_url + "/messages", json=body, timeout=60)
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        error = resp.json()
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"} and error["error"]["message"]


def test_missing_max_tokens_unknown_models_and_other_paths_are_anthropic_errors(live, client):
    resp = httpx.post(live.api_url + "/messages", json={"model": MODEL, "messages": ask("Hi")}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in resp.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=ask("Hi"))
    assert caught.value.body["error"]["type"] == "not_found_error"
    resp = httpx.get(live.api_url + "/messages", timeout=10)
    assert resp.status_code == 405 and resp.json()["type"] == "error"
    assert "error" in httpx.post(live.api_url + "/chat/completions", json={}, timeout=10).json()  # still OpenAI's
    assert "type" not in httpx.post(live.api_url + "/chat/completions", json={}, timeout=10).json()


def test_x_api_key_is_accepted_as_the_key(secured):
    message = sdk(secured, RESPONSES_KEYS[0]).messages.create(model=MODEL, max_tokens=2, messages=ask("Hi"))
    assert message.type == "message"
    with pytest.raises(anthropic.AuthenticationError):
        sdk(secured, "not-a-key").messages.create(model=MODEL, max_tokens=2, messages=ask("Hi"))
    # refused before the route runs (the key is checked before the body is read): Anthropic's envelope too
    resp = httpx.post(secured.api_url + "/messages", headers={"x-api-key": "not-a-key"}, timeout=10,
                      json={"model": MODEL, "max_tokens": 2, "messages": ask("Hi")})
    assert resp.status_code == 401
    assert resp.json() == {"type": "error", "error": {"type": "authentication_error", "message": resp.json()[
        "error"]["message"]}}
    chat = httpx.post(secured.api_url + "/chat/completions", headers={"Authorization": "Bearer not-a-key"},
                      json={"messages": ask("Hi")}, timeout=10)
    assert chat.status_code == 401 and chat.json()["error"]["type"] == "invalid_request_error"  # OpenAI's


def test_a_thread_is_its_keys_alone(secured):
    """Another key's message id is not found, as an id never sent is: threads are per key."""
    owner, other = sdk(secured, RESPONSES_KEYS[0]), sdk(secured, RESPONSES_KEYS[1])
    first = owner.beta.messages.create(model=MODEL, max_tokens=2, messages=ask("Hi"), system=SYSTEM,
                                       thread={"type": "create"}, extra_body=GREEDY)
    follow = {"model": MODEL, "max_tokens": 2, "messages": ask("More?"), "extra_body": GREEDY,
              "thread": {"type": "continue", "previous_message_id": first.id}}
    with pytest.raises(anthropic.NotFoundError) as caught:
        other.beta.messages.create(**follow)
    assert caught.value.body["error"]["details"] == {"error_code": "thread_not_found"}
    second = owner.beta.messages.create(**follow)
    whole = owner.messages.count_tokens(model=MODEL, system=SYSTEM, messages=[
        *ask("Hi"), {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        *ask("More?")]) if first.content else None
    usage = second.usage
    total = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert whole is None or total == whole.input_tokens


# ---- the scripted model: text and tool calls it is told to write --------------------------------


@pytest.fixture(scope="module")
def scripted(tiny_model_dir, tmp_path_factory):
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "served_model_name": MODEL,
                                        "min_prefix_tokens": 8, "disk_budget_bytes": 0,
                                        "cache_dir": str(tmp_path_factory.mktemp("cache"))}, environ={})
    with serve_app(create_app(settings, scripted_runtime)) as live:
        yield live


def test_a_tool_use_turn_and_its_tool_result_continue_the_conversation(scripted):
    client = sdk(scripted)
    args = dict(model=MODEL, max_tokens=200, system=SYSTEM, tools=[ORDER_TOOL], extra_body=GREEDY)
    question = {"role": "user", "content": script(hermes_calls(("get_order_details", ORDER_ARGS)))}
    first = client.messages.create(messages=[question], **args)
    assert first.stop_reason == "tool_use"
    [call] = first.content
    assert call.type == "tool_use" and call.name == "get_order_details" and call.input == ORDER_ARGS
    answer = f"Order {ORDER_ID} was delivered."
    result = {"type": "tool_result", "tool_use_id": call.id,
              "content": [{"type": "text", "text": tool_result({"status": "delivered"}, answer)}]}
    second = client.messages.create(messages=[question, {"role": "assistant", "content": first.content},
                                              {"role": "user", "content": [result]}], **args)
    assert second.stop_reason == "end_turn" and [(b.type, b.text) for b in second.content] == [("text", answer)]
    assert second.usage.cache_read_input_tokens > 0  # the tool group


def test_streamed_text_and_calls_arrive_as_their_blocks(scripted):
    client = sdk(scripted)
    with client.messages.stream(model=MODEL, max_tokens=50, messages=ask(script("All done.")),
                                extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == "All done." and final.stop_reason == "end_turn"
    reply = "Checking. " + hermes_calls(("get_order_details", ORDER_ARGS), ("get_order_details", {"order_id": "#W1"}))
    events = sse(scripted, {"model": MODEL, "max_tokens": 200, "tools": [ORDER_TOOL], "temperature": 0,
                            "messages": ask(script(reply))})
    starts = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert [block["type"] for block in starts] == ["text", "tool_use", "tool_use"]
    assert all(block["input"] == {} and block["id"].startswith("toolu_") for block in starts[1:])
    inputs = ["".join(data["delta"]["partial_json"] for name, data in events
                      if name == "content_block_delta" and data["index"] == index) for index in (1, 2)]
    assert [json.loads(text) for text in inputs] == [ORDER_ARGS, {"order_id": "#W1"}]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_a_stop_sequence_that_ends_the_answer_is_named_whole_and_streamed(scripted):
    """Anthropic reports which of the request's `stop_sequences` ended the message (`stop_reason`
    `stop_sequence`); an answer that ends on its own says `end_turn` and `stop_sequence` null."""
    client = sdk(scripted)
    args = dict(model=MODEL, max_tokens=50, messages=ask(script("Order shipped. END here.")),
                stop_sequences=["NEVER", "END"], extra_body=GREEDY)
    whole = client.messages.create(**args)
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", "END")
    assert [(b.type, b.text) for b in whole.content] == [("text", "Order shipped. ")]
    with client.messages.stream(**args) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", "END")
    unstopped = client.messages.create(**{**args, "stop_sequences": ["NEVER"]})
    assert (unstopped.stop_reason, unstopped.stop_sequence) == ("end_turn", None)
