"""What the proxy changes in a body and reads from an answer, without a server: the tool group
(the same id the model path computes), canonical tool order, cache_salt, usage asked of a
stream; SSE cut into events byte for byte, whatever the chunking; usage found in answers."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from adapters.base import ToolGroup
from adapters.render import _split_system
from gateway.errors import BadRequest
from gateway.protocol.chat import ChatCompletionRequest
from gateway.proxy.events import EventSplitter, StreamBroken, body_usage, event_usage, has_data
from gateway.proxy.metrics import Usage
from gateway.proxy.shaping import shape
from gateway.settings import load_settings

SETTINGS = load_settings(environ={})
SALTED = load_settings(overrides={"upstream_cache_salt": "tenant"}, environ={})


def tool(name: str, size: int) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": "d" * size,
                                             "parameters": {"type": "object", "properties": {}}}}


TOOLS = [tool("lookup", 40), tool("refund", 90), tool("cancel", 10), tool("ship", 90)]
MESSAGES = [{"role": "system", "content": "You help."}, {"role": "developer", "content": [{"type": "text",
                                                                                       "text": "Be brief."}]},
            {"role": "user", "content": "hi"}]


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(MESSAGES), "tools": list(TOOLS), **extra}


def shaped(data: dict[str, Any], settings=SETTINGS, salt: str = "") -> tuple[Any, dict[str, Any]]:
    fwd = shape("chat", data, settings, lambda group_id: salt)
    return fwd, orjson.loads(fwd.body)


def local_group_id(data: dict[str, Any]) -> str:
    """The model path's id: protocol types, the renderer's system split, ToolGroup."""
    req = ChatCompletionRequest.model_validate(data)
    system, _ = _split_system([m.to_chat() for m in req.messages])
    return ToolGroup.of(system, [t.to_spec() for t in req.tools or ()]).group_id


def test_the_group_id_is_the_model_paths_and_ignores_tool_order():
    fwd, _ = shaped(chat())
    assert fwd.group_id == local_group_id(chat())
    for seed in range(5):
        tools = list(TOOLS)
        random.Random(seed).shuffle(tools)
        assert shaped(chat(tools=tools))[0].group_id == fwd.group_id


def test_tools_go_upstream_in_canonical_order_with_their_other_fields():
    strict = {**TOOLS[2], "function": {**TOOLS[2]["function"], "strict": True}}
    _, body = shaped(chat(tools=[strict, TOOLS[0], TOOLS[3], TOOLS[1]]))
    assert [t["function"]["name"] for t in body["tools"]] == ["refund", "ship", "lookup", "cancel"]
    assert body["tools"][3]["function"]["strict"] is True
    assert body["messages"] == MESSAGES


def test_tools_that_are_not_all_functions_stay_as_sent():
    tools = [TOOLS[2], {"type": "web_search"}, TOOLS[1]]
    _, body = shaped(chat(tools=tools))
    assert body["tools"] == tools


def test_a_different_system_prompt_is_a_different_group():
    other = chat(messages=[{"role": "system", "content": "Other."}, {"role": "user", "content": "hi"}])
    assert shaped(other)[0].group_id != shaped(chat())[0].group_id


def test_cache_salt_is_the_tenants_when_configured_and_never_the_clients():
    _, body = shaped(chat(cache_salt="chosen-by-client"), SALTED, salt="tenant-salt")
    assert body["cache_salt"] == "tenant-salt"
    _, shared = shaped(chat(cache_salt="chosen-by-client"), SALTED, salt="")  # shared group / open proxy
    assert "cache_salt" not in shared
    _, off = shaped(chat(cache_salt="chosen-by-client"), SETTINGS, salt="tenant-salt")
    assert off["cache_salt"] == "chosen-by-client"  # off: the body goes as sent


def test_a_stream_asks_for_usage_and_remembers_whether_the_client_did():
    fwd, body = shaped(chat(stream=True, stream_options={"include_usage": False, "other": 1}))
    assert body["stream_options"] == {"include_usage": True, "other": 1} and not fwd.client_usage
    fwd, body = shaped(chat(stream=True, stream_options={"include_usage": True}))
    assert fwd.client_usage and fwd.stream
    fwd, body = shaped(chat())
    assert "stream_options" not in body and not fwd.stream


def test_responses_group_from_instructions_and_flat_tools():
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    fwd = shape("responses", {"instructions": "You help.", "input": "hi", "tools": flat}, SETTINGS, lambda g: "")
    again = shape("responses", {"instructions": "You help.", "input": [{"role": "user", "content": "x"}],
                                "tools": flat[::-1]}, SETTINGS, lambda g: "")
    assert fwd.group_id == again.group_id and fwd.client_usage
    assert [t["name"] for t in orjson.loads(again.body)["tools"]] == ["refund", "ship", "lookup", "cancel"]


def test_text_completions_route_by_the_prompts_head():
    a = shape("completions", {"prompt": "x" * 2000 + "a"}, SETTINGS, lambda g: "")
    b = shape("completions", {"prompt": ["x" * 2000 + "b"]}, SETTINGS, lambda g: "")
    c = shape("completions", {"prompt": "y" * 2000}, SETTINGS, lambda g: "")
    assert a.group_id == b.group_id != c.group_id


def test_too_many_tools_or_messages_is_a_400_naming_the_field():
    small = load_settings(overrides={"max_tools": 2, "max_messages": 2}, environ={})
    with pytest.raises(BadRequest) as tools:
        shaped(chat(messages=MESSAGES[2:]), small)
    assert tools.value.param == "tools"
    with pytest.raises(BadRequest) as messages:
        shaped(chat(tools=TOOLS[:1]), small)
    assert messages.value.param == "messages"


STREAM = (b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n'
          b'data: {"choices":[{"delta":{"content":"hi"}}]}\r\n\r\n'
          b': ping\n\n'
          b'data: {"choices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
          b'data: [DONE]\n\n')


@pytest.mark.parametrize("size", [1, 2, 7, 50, len(STREAM)])
def test_events_come_out_whole_and_byte_for_byte_whatever_the_chunking(size):
    splitter = EventSplitter()
    events = [e for at in range(0, len(STREAM), size) for e in splitter.feed(STREAM[at:at + size])]
    assert b"".join(events) == STREAM and splitter.rest() == b""
    assert len(events) == 5


def test_a_comment_is_no_data_event():
    assert [has_data(e) for e in EventSplitter().feed(STREAM)] == [True, True, False, True, True]


def test_an_upstream_that_never_ends_an_event_is_broken():
    with pytest.raises(StreamBroken):
        EventSplitter().feed(b"data: " + b"x" * (9 * 1024**2))


def test_the_usage_only_chunk_is_recognised_and_read():
    events = EventSplitter().feed(STREAM)
    assert [event_usage("chat", e) for e in events] == [
        (None, False), (None, False), (None, False), (Usage(prompt_tokens=9, cached_tokens=4), True), (None, False)]
    carried = b'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":3}}\n\n'  # llama.cpp-style: kept
    assert event_usage("chat", carried) == (Usage(prompt_tokens=3, cached_tokens=None), False)


def test_usage_of_whole_answers_and_responses_events():
    assert body_usage("chat", {"usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}}) \
        == Usage(5, 0)
    assert body_usage("chat", {"usage": None}) is None
    completed = {"type": "response.completed",
                 "response": {"usage": {"input_tokens": 8, "input_tokens_details": {"cached_tokens": 6}}}}
    assert body_usage("responses", completed) == Usage(8, 6)
    assert body_usage("responses", completed["response"]) == Usage(8, 6)  # a whole Responses answer
    assert Usage(8, 6).result == "hit" and Usage(8, 0).result == "miss" and Usage(8, None).result == "unknown"
