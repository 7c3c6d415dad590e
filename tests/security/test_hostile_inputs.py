"""Hostile request bodies against a real server: each gets a 4xx in the OpenAI envelope that names
the field, before any expensive work, and the server stays healthy for everyone else."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

SYSTEM = {"role": "system", "content": "You are a merchant assistant."}
HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


def post(live, payload, **kwargs):
    return httpx.post(live.api_url + "/chat/completions", json=payload, timeout=120, **kwargs)


def rejected(resp, status=400, param=None):
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    return error


def nested_object(depth: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"x": value}}
    return value


def test_deep_nesting_anywhere_is_a_400_never_a_500(live):
    tool = {"type": "function", "function": {"name": "deep", "parameters": nested_object(300)}}
    rejected(post(live, dict(HI, tools=[tool])))
    shallow_enough = {"type": "function", "function": {"name": "deep", "parameters": nested_object(20)}}
    rejected(post(live, dict(HI, tools=[shallow_enough])), param="tools[0].function.parameters")

    args_object: dict = {}
    for _ in range(1000):
        args_object = {"a": args_object}
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": args_object}}
    history = [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    resp = httpx.post(live.api_url + "/chat/completions", content=_dumps_deep(dict(HI, messages=history)),
                      headers={"content-type": "application/json"}, timeout=60)
    rejected(resp)

    text_call = dict(call, function={"name": "f", "arguments": "[" * 5000 + "]" * 5000})
    history[1] = {"role": "assistant", "content": None, "tool_calls": [text_call]}
    rejected(post(live, dict(HI, messages=history)), param="messages[1].tool_calls[0].function.arguments")
    text_call = dict(call, function={"name": "f", "arguments": "[" * 100 + "]" * 100})
    history[1] = {"role": "assistant", "content": None, "tool_calls": [text_call]}
    rejected(post(live, dict(HI, messages=history)), param="messages[1].tool_calls[0].function.arguments")
    assert post(live, HI).status_code == 200


def test_call_arguments_python_would_parse_but_json_does_not_are_served_as_text(live):
    """A lone surrogate escape or a NaN ahead of deep nesting in a history call's arguments: the
    depth check takes them for text (not JSON), and so does the prompt (before, a 500 that also
    dropped the client's connection)."""
    with httpx.Client(base_url=live.api_url, timeout=120) as client:  # one connection throughout
        for arguments in ('{"a": "\\ud800"}', "[NaN," + "[" * 1200 + "]" * 1200 + "]"):
            call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
            history = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "c1", "content": "42"}]
            resp = client.post("/chat/completions", json=dict(HI, messages=history))
            assert resp.status_code == 200, resp.text
        assert client.post("/chat/completions", json=HI).status_code == 200


def _dumps_deep(value: object) -> bytes:
    """json.dumps for a body deeper than Python's recursion limit allows (the server must cope)."""
    depth, inner = 0, value["messages"][1]["tool_calls"][0]["function"]["arguments"]  # type: ignore[index]
    while inner:
        depth, inner = depth + 1, inner["a"]
    marker = '"__deep__"'
    value["messages"][1]["tool_calls"][0]["function"]["arguments"] = "__deep__"  # type: ignore[index]
    text = json.dumps(value).replace(marker, '{"a": ' * depth + "{}" + "}" * depth)
    return text.encode()


def test_integers_are_range_checked_and_strings_are_not_numbers(live):
    rejected(post(live, dict(HI, seed="100000000000000000000000")), param="seed")
    rejected(post(live, dict(HI, seed=10**23)), param="seed")
    rejected(post(live, dict(HI, stream="yes")), param="stream")
    rejected(post(live, dict(HI, max_tokens="5")), param="max_tokens")
    rejected(post(live, dict(HI, temperature="0")), param="temperature")
    rejected(post(live, dict(HI, max_tokens=True)), param="max_tokens")
    assert post(live, dict(HI, seed=2**63 - 1, temperature=1.0)).status_code == 200
    assert post(live, dict(HI, seed=-(2**63), temperature=1.0)).status_code == 200


@pytest.mark.parametrize(("field", "value"), [
    ("audio", {"voice": "alloy", "format": "mp3"}), ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}), ("reasoning_effort", "high"), ("store", True),
])
def test_unsupported_openai_fields_are_a_400_naming_the_field_not_ignored(live, field, value):
    error = rejected(post(live, dict(HI, **{field: value})), param=field)
    assert field in error["message"]


def test_unsupported_fields_at_their_no_op_defaults_are_accepted(live):
    body = dict(HI, logprobs=False, frequency_penalty=0, presence_penalty=0.0, logit_bias={},
                response_format={"type": "text"}, modalities=["text"], store=False, service_tier="auto",
                metadata={"k": "v"}, user="u-1")
    assert post(live, body).status_code == 200


def test_oversized_prompts_are_rejected_without_tokenizing_and_leave_nothing_behind(live):
    service = live.app.state.gateway.model.runtime.service
    chars = service.context_len * service.max_token_chars + 1
    before = service.prompt_tokens.remembered()
    for index in range(3):  # distinct system prompts, as in the report: each used to leave its head behind
        huge = {"messages": [{"role": "system", "content": f"system {index} " + "x" * chars},
                             {"role": "user", "content": "hi"}]}
        error = rejected(post(live, huge))
        assert error["code"] == "context_length_exceeded"
    # Over the context after tokenizing (under the character bound): rejected, and not remembered.
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "word " * 200}}
             for i in range(40)]
    for index in range(2):
        body = {"messages": [{"role": "system", "content": f"system {index}"}, {"role": "user", "content": "hi"}],
                "tools": tools}
        error = rejected(post(live, body))
        assert error["code"] == "context_length_exceeded"
    assert service.prompt_tokens.remembered() == before


def test_long_prompts_are_prepared_off_the_event_loop(live):
    """Three long prompts (rendered and tokenized on worker threads) while /health is polled: the
    loop answers each poll at once. Before, rendering ran on the loop and /health took 10-21 s."""
    service = live.app.state.gateway.model.runtime.service
    text = " ".join(f"w{i}" for i in range(service.context_len * 2))  # far over the context in tokens
    assert len(text) < service.context_len * service.max_token_chars  # ... but not by characters
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
    results: list[int] = []
    workers = [threading.Thread(target=lambda: results.append(post(live, body).status_code)) for _ in range(3)]
    for worker in workers:
        worker.start()
    slowest = 0.0
    while any(worker.is_alive() for worker in workers):
        started = time.perf_counter()
        assert httpx.get(live.base_url + "/health", timeout=10).status_code == 200
        slowest = max(slowest, time.perf_counter() - started)
    for worker in workers:
        worker.join()
    assert results == [400, 400, 400]
    assert slowest < 1.0, f"/health took {slowest:.2f}s while long prompts were prepared"
