"""The chat API as an OpenAI client sees it: shapes (validated against OpenAI's schemas),
streaming, usage with cached tokens, and errors in OpenAI's envelope."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.support.waiting import wait_until

SYSTEM = {"role": "system", "content": "You are a merchant assistant."}


def ask(question: str) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": question}]


def sse_events(live, body: dict[str, Any], headers: dict[str, str] | None = None) -> list[str]:
    with httpx.stream("POST", live.api_url + "/chat/completions", json=body, headers=headers,
                      timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        return [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]


def test_non_stream_response_has_openai_shape_and_cached_tokens(client, merchant_tools, openai_schema):
    first = client.chat.completions.create(model="tiny-llama", messages=ask("GMV?"), tools=merchant_tools[:5],
                                           tool_choice="none", temperature=0, max_tokens=8)
    second = client.chat.completions.create(model="tiny-llama", messages=ask("Refunds?"), tools=merchant_tools[:5],
                                            tool_choice="none", temperature=0, max_tokens=8)
    for resp in (first, second):
        openai_schema("CreateChatCompletionResponse", resp.model_dump(exclude_unset=True))
        assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
        assert resp.choices[0].message.role == "assistant"
        assert resp.choices[0].finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # never seen: a miss computes
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert second.usage.total_tokens == second.usage.prompt_tokens + second.usage.completion_tokens


def test_stream_chunks_follow_openai_protocol(live, merchant_tools, openai_schema):
    body = {"model": "tiny-llama", "messages": ask("Top products?"), "tools": merchant_tools[:3],
            "tool_choice": "none", "temperature": 0, "max_tokens": 10, "stream": True,
            "stream_options": {"include_usage": True}}
    events = sse_events(live, body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        openai_schema("CreateChatCompletionStreamResponse", chunk)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len({c["id"] for c in chunks}) == 1
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert [f for f in finishes if f is not None] == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert "cached_tokens" in chunks[-1]["usage"]["prompt_tokens_details"]


def test_stream_without_include_usage_has_no_usage_chunk(live):
    body = {"messages": ask("Hi"), "max_tokens": 4, "temperature": 0, "stream": True}
    chunks = [json.loads(e) for e in sse_events(live, body)[:-1]]
    assert all(c["choices"] for c in chunks)
    assert all("usage" not in c for c in chunks)


def test_stream_text_equals_non_stream_text(client, merchant_tools):
    args = dict(model="tiny-llama", messages=ask("Inventory?"), tools=merchant_tools[:4], tool_choice="none",
                temperature=0, max_tokens=12)
    whole = client.chat.completions.create(**args).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**args, stream=True)
                       if c.choices)
    assert streamed == whole


def test_bypass_header_computes_everything_and_matches(client, merchant_tools):
    args = dict(model="tiny-llama", messages=ask("Orders?"), tools=merchant_tools[:5], tool_choice="none",
                temperature=0, max_tokens=12)
    cached = client.chat.completions.create(**args)
    cached = client.chat.completions.create(**args)
    plain = client.chat.completions.create(**args, extra_headers={"X-Toolkv-Cache": "bypass"})
    assert cached.usage.prompt_tokens_details.cached_tokens > 0
    assert plain.usage.prompt_tokens_details.cached_tokens == 0
    assert plain.choices[0].message.content == cached.choices[0].message.content


def test_usage_reports_cache_writes_apart_from_reads(client, merchant_tools):
    """A miss writes its tool group to the cache (`cache_write_tokens`), a hit reads as many back
    (`cached_tokens`) and writes nothing, streamed or not; a bypass does neither."""
    args = dict(model="tiny-llama", tools=merchant_tools[30:34], tool_choice="none", temperature=0, max_tokens=2)

    def details(question: str, **extra: Any) -> Any:
        return client.chat.completions.create(messages=ask(question), **args, **extra).usage.prompt_tokens_details

    miss, hit = details("Stock?"), details("Returns?")
    *_, last = client.chat.completions.create(messages=ask("Margins?"), stream=True,
                                              stream_options={"include_usage": True}, **args)
    bypass = details("Stock?", extra_headers={"X-Toolkv-Cache": "bypass"})
    assert miss.cached_tokens == 0 < miss.cache_write_tokens
    assert (hit.cached_tokens, hit.cache_write_tokens) == (miss.cache_write_tokens, 0)
    streamed = last.usage.prompt_tokens_details
    assert (streamed.cached_tokens, streamed.cache_write_tokens) == (miss.cache_write_tokens, 0)
    assert (bypass.cached_tokens, bypass.cache_write_tokens) == (0, 0)


def server_timing(header: str) -> dict[str, float]:
    parts = (p.strip().split(";dur=") for p in header.split(","))
    return {name: float(ms) for name, ms in parts}


@pytest.mark.parametrize("stream", [False, True])
def test_cache_result_and_server_timing_headers(client, merchant_tools, stream):
    """What a hit spent where: no compile, no restore (it reads the group in place), and the
    model's own prefill of the suffix."""
    args = dict(model="tiny-llama", tools=merchant_tools[10 + stream : 16], tool_choice="none", temperature=0,
                max_tokens=3, stream=stream)
    seen = []
    for question, headers in (("Stock?", {}), ("Returns?", {}), ("Margins?", {"X-Toolkv-Cache": "bypass"})):
        raw = client.chat.completions.with_raw_response.create(messages=ask(question), extra_headers=headers, **args)
        seen.append((raw.headers["x-toolkv-cache"], server_timing(raw.headers["server-timing"])))
        if stream:
            assert [c for c in raw.parse()][-1].choices[0].finish_reason == "length"
    (miss, t_miss), (hit, t_hit), (bypass, t_bypass) = seen
    assert (miss, hit, bypass) == ("miss", "hit", "bypass")
    assert set(t_hit) == {"prepare", "queue", "lookup", "compile", "restore", "prefill"}
    assert t_miss["compile"] > 0 and t_hit["compile"] == 0 and t_hit["restore"] == 0  # read in place
    assert all(t["prefill"] > 0 and t["prepare"] > 0 for t in (t_miss, t_hit, t_bypass))


def test_message_forms_are_accepted(client):
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Look up order 7"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_order", "arguments": "{\"id\": 7}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"status\": \"shipped\"}"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot share the address."}]},
        {"role": "user", "content": "Thanks"},
    ]
    resp = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=3, temperature=0,
                                          seed=1, top_p=0.5, user="u1", prompt_cache_key="k",
                                          extra_body={"some_vendor_field": True})
    assert resp.choices[0].finish_reason in ("stop", "length")
    # OpenAI's bounds and its no-op values: top_p 0 (the likeliest token), the caller's own ids and tags
    greedy = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=3, top_p=0,
                                            safety_identifier="user-7", metadata={"team": "a"},
                                            extra_body={"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}})
    assert greedy.choices[0].message.content == client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=3, temperature=0).choices[0].message.content


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    assert client.models.retrieve("tiny-llama").id == "tiny-llama"  # the SDK's `retrieve` was a 404
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert info.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("body, status, param, code", [
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n", None),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature", None),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", None),
    ({"messages": []}, 400, "messages", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
     400, "messages[0].content[0].type", "unsupported_parameter"),  # was: "Input should be a valid string"
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]}, 400, "messages[1]", None),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, 400, "max_tokens", None),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, 400, "max_tokens",
     "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, 404, "model", "model_not_found"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "a"}}],
      "tool_choice": {"type": "function", "function": {"name": "b"}}}, 400, "tool_choice", None),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
     "tools[0].function", None),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
        "name": "a", "parameters": {"type": "string"}}}]}, 400, "tools[0].function.parameters", None),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, 400,
     "stream_options", None),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt_cache_options": {"mode": "explicit"}}, 400,
     "prompt_cache_options", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6}, 400, "max_completion_tokens",
     "context_length_exceeded"),
])
def test_bad_requests_get_openai_error_envelopes(live, body, status, param, code):
    resp = httpx.post(live.api_url + "/chat/completions", json=body, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert code is None or error["code"] == code
    assert error["message"]


def test_invalid_json_and_unknown_route_are_enveloped(live):
    bad = httpx.post(live.api_url + "/chat/completions", content=b"{not json",
                     headers={"content-type": "application/json"}, timeout=10)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    missing = httpx.get(live.base_url + "/v1/nothing", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_sdk_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-llama", messages=ask("x"), n=3)
    assert info.value.body["param"] == "n"


def test_one_structured_log_line_per_request_without_the_prompt(client, merchant_tools, caplog):
    import logging

    from gateway.logs import _JsonFormatter

    with caplog.at_level(logging.INFO, logger="gateway.serving.service"):
        resp = client.chat.completions.create(model="tiny-llama", messages=ask("secret question 42"),
                                              tools=merchant_tools[:3], tool_choice="none", max_tokens=3)
    records = [r for r in caplog.records if r.getMessage() == "request done"]
    assert len(records) == 1
    line = json.loads(_JsonFormatter().format(records[0]))
    assert line["request_id"] == resp.id
    assert line["group_id"].startswith("tg_") and line["status"] == "200"
    assert line["prompt_tokens"] == resp.usage.prompt_tokens
    assert {"cached_tokens", "completion_tokens", "ttft_ms"} <= set(line)
    assert "secret question" not in json.dumps(line)


def test_every_response_and_chunk_names_the_same_system_fingerprint(live, client, merchant_tools):
    """OpenAI's spec: a string naming the backend configuration; stable while the model, tokenizer,
    template and settings that shape output stay the same."""
    whole = [client.chat.completions.create(model="tiny-llama", messages=ask(q), temperature=0, max_tokens=3)
             for q in ("Hi", "Hello")]
    fingerprint = whole[0].system_fingerprint
    assert isinstance(fingerprint, str) and fingerprint.startswith("fp_") and len(fingerprint) > 6
    assert whole[1].system_fingerprint == fingerprint
    chunks = [json.loads(event) for event in sse_events(live, {"model": "tiny-llama", "messages": ask("Yo"),
                                                               "max_tokens": 3, "stream": True})
              if event != "[DONE]"]
    assert chunks and all(chunk["system_fingerprint"] == fingerprint for chunk in chunks)


def test_a_client_that_hangs_up_mid_stream_is_counted_with_the_tokens_it_was_sent(live):
    """The request log and `toolkv_generated_tokens_total` count what was generated for a client
    that left (before, 0: only a finished answer's count was taken)."""
    metrics = live.app.state.gateway.metrics
    generated, hangups = metrics.generated_tokens._value.get(), metrics.requests.labels(status="499", stream="true")
    left_before = hangups._value.get()
    body = {"model": "tiny-llama", "messages": ask("Count forever"), "max_tokens": 3000, "stream": True,
            "temperature": 0}  # greedy runs to the limit: the client leaves first
    with httpx.stream("POST", live.api_url + "/chat/completions", json=body, timeout=60) as resp:
        lines = (line for line in resp.iter_lines() if line.startswith("data: "))
        chunks = [json.loads(next(lines)[len("data: "):]) for _ in range(6)]
    sent = sum(1 for chunk in chunks if chunk["choices"] and chunk["choices"][0]["delta"].get("content"))
    assert wait_until(lambda: hangups._value.get() == left_before + 1)  # the server notices the hang-up on its own
    assert metrics.generated_tokens._value.get() - generated >= sent >= 4
