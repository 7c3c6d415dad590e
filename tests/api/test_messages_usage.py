"""Messages usage that adds up, `request-id` on every answer, and `POST /v1/messages/count_tokens`,
through the real `anthropic` SDK: on every path (a miss, a hit, a partial tool-group reuse, a
conversation reuse; whole and streamed) `input_tokens + cache_read_input_tokens +
cache_creation_input_tokens` is the prompt, and the prompt is what `count_tokens` says."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from tests.api.test_messages_api import GREEDY, MODEL, SYSTEM, anthropic_tools, ask, sdk

SMALL_TOOL = {"name": "zz_ping", "description": "Ping.", "input_schema": {"type": "object"}}  # sorted last


def prompt_of(usage: Any) -> int:
    return int(usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens)


@pytest.fixture
def client(live) -> anthropic.Anthropic:
    return sdk(live)


def send(client: anthropic.Anthropic, streamed: bool, **args: Any) -> tuple[str, Any, int]:
    """(X-Toolkv-Cache, the message's usage, count_tokens of the same request)."""
    counted = client.messages.count_tokens(**{k: v for k, v in args.items()
                                              if k not in ("max_tokens", "extra_body")}).input_tokens
    if not streamed:
        raw = client.messages.with_raw_response.create(**args)
        return raw.headers["x-toolkv-cache"], raw.parse().usage, counted
    with client.messages.stream(**args) as stream:
        final = stream.get_final_message()
        started = stream.response.headers["x-toolkv-cache"]
    return started, final.usage, counted


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_usage_adds_up_to_the_prompt_on_a_miss_a_hit_a_partial_group_and_a_conversation(client, merchant_tools,
                                                                                         streamed):
    """Fails on 8363295: a partial group reuse counted its read tokens again as written."""
    tools = anthropic_tools(merchant_tools[60 + 6 * streamed:66 + 6 * streamed])
    args: dict[str, Any] = dict(model=MODEL, max_tokens=3, system=SYSTEM, tools=tools, tool_choice={"type": "none"},
                                extra_body=GREEDY)
    result, miss, counted = send(client, streamed, messages=ask("GMV?"), **args)
    assert result == "miss" and prompt_of(miss) == counted
    assert miss.cache_read_input_tokens == 0 < miss.cache_creation_input_tokens < counted
    result, hit, counted = send(client, streamed, messages=ask("Refunds?"), **args)
    assert result == "hit" and prompt_of(hit) == counted
    assert hit.cache_creation_input_tokens == 0 and hit.cache_read_input_tokens >= miss.cache_creation_input_tokens
    # one tool more: a new group, started from the cached one's common head
    result, partial, counted = send(client, streamed, messages=ask("GMV?"), **{**args, "tools": [*tools, SMALL_TOOL]})
    assert result == "miss" and prompt_of(partial) == counted
    assert partial.cache_read_input_tokens > 0 and partial.cache_creation_input_tokens > 0
    group = partial.cache_read_input_tokens + partial.cache_creation_input_tokens
    conversation = [*ask("GMV?"), {"role": "assistant", "content": "GMV was 10."}, *ask("And refunds?")]
    send(client, streamed, messages=conversation, **{**args, "tools": [*tools, SMALL_TOOL]})  # its record
    longer = [*conversation, {"role": "assistant", "content": "Refunds were 2."}, *ask("Stock?")]
    result, reused, counted = send(client, streamed, messages=longer, **{**args, "tools": [*tools, SMALL_TOOL]})
    assert result == "hit" and prompt_of(reused) == counted
    assert reused.cache_read_input_tokens > group and reused.cache_creation_input_tokens == 0


def test_streamed_usage_adds_up_at_the_start_and_at_the_end(live, merchant_tools):
    body = {"model": MODEL, "max_tokens": 3, "system": SYSTEM, "tools": anthropic_tools(merchant_tools[72:76]),
            "tool_choice": {"type": "none"}, "temperature": 0, "messages": ask("GMV?"), "stream": True}
    counted = httpx.post(live.api_url + "/messages/count_tokens", json=body, timeout=60).json()["input_tokens"]
    for _ in range(2):  # a miss, then a hit
        with httpx.stream("POST", live.api_url + "/messages", json=body, timeout=60) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        events = [httpx.Response(200, content=line[len("data: "):]).json() for line in lines]
        start = events[0]["message"]["usage"]
        end = next(event["usage"] for event in events if event["type"] == "message_delta")
        for usage in (start, end):
            assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage[
                "cache_creation_input_tokens"] == counted


def test_count_tokens_validates_as_messages_do_and_ignores_max_tokens(live, client):
    body = {"model": MODEL, "messages": ask("Hi"), "system": SYSTEM}
    plain = httpx.post(live.api_url + "/messages/count_tokens", json=body, timeout=60)
    assert plain.status_code == 200 and set(plain.json()) == {"input_tokens"} and plain.json()["input_tokens"] > 0
    sized = httpx.post(live.api_url + "/messages/count_tokens", json={**body, "max_tokens": 10**6}, timeout=60)
    assert sized.json() == plain.json()
    assert client.messages.count_tokens(model=MODEL, messages=ask("Hi"), system=SYSTEM).input_tokens == plain.json()[
        "input_tokens"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.count_tokens(model=MODEL, messages=ask("Hi"), extra_body={"top_k": 3})
    assert caught.value.body["error"]["type"] == "invalid_request_error" and "top_k" in caught.value.message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-opus-4-1", messages=ask("Hi"))


def test_every_messages_answer_has_a_request_id(live, client, secured):
    """Fails on 8363295: no `request-id` header, so the SDK's `_request_id` was None."""
    message = client.messages.create(model=MODEL, max_tokens=2, messages=ask("Hi"), extra_body=GREEDY)
    assert message._request_id == message.id  # the id the server logs the request under
    with client.messages.stream(model=MODEL, max_tokens=2, messages=ask("Hi"), extra_body=GREEDY) as stream:
        assert stream.response.headers["request-id"].startswith("msg_")
    assert client.messages.count_tokens(model=MODEL, messages=ask("Hi"))._request_id.startswith("req_")
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=2, messages=[])
    with pytest.raises(anthropic.AuthenticationError) as refused:  # answered before the route runs
        sdk(secured, "not-a-key").messages.create(model=MODEL, max_tokens=2, messages=ask("Hi"))
    ids = [bad.value.request_id, refused.value.request_id,
           httpx.get(live.api_url + "/messages", timeout=10).headers.get("request-id")]
    assert all(ids) and len(set(ids)) == 3
    assert "request-id" not in httpx.post(live.api_url + "/chat/completions", json={}, timeout=10).headers
