"""End to end: `toolkv serve` in its own process on the embedded SmolLM2 model, driven by the
openai SDK. The second request with the same 16 tools (tau-bench retail's, as `toolkv parity`
sends them) is served from the cache, with the same text as a request that bypasses it.

A full prefill of the real model (a miss or a bypass: ~3,000 tokens) is ~25 s of a quiet 2-core
machine, a hit ~1 s: the module's tests share one group, compiled once (`retail`), and each
property that needs a bypass compares against one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from gateway.cli.parity import DEFAULT_SYSTEM, DEFAULT_TOOLS_FILE, RETAIL_QUERIES
from tests.support.models import DefaultModelCopy
from tests.support.server import free_port, wait_until_ready

pytestmark = pytest.mark.e2e

SYSTEM = {"role": "system", "content": DEFAULT_SYSTEM}


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory, default_model_copy: DefaultModelCopy) -> Iterator[str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLKV_")}
    log = tmp_path_factory.mktemp("e2e-log") / "server.log"
    cache_dir = default_model_copy.fresh(tmp_path_factory.mktemp("e2e-cache"))
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--cache-dir", str(cache_dir)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                cwd=Path(__file__).resolve().parents[2])
    try:
        base = f"http://127.0.0.1:{port}"
        status = wait_until_ready(base)
        assert status["status"] == "ok", log.read_text()[-3000:]
        yield base + "/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tools():
    return json.loads(DEFAULT_TOOLS_FILE.read_text())


def ask(client: openai.OpenAI, tools, question: str, tool_choice="none", max_tokens=24, **extra):
    return client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[SYSTEM, {"role": "user", "content": question}],
        tools=tools, tool_choice=tool_choice, temperature=0, max_tokens=max_tokens, **extra)


@pytest.fixture(scope="module")
def first(client, tools):
    """The group's first request (a miss: it compiles the system prompt and the 16 tools)."""
    return ask(client, tools, "What was our GMV last week?")


def test_second_request_hits_the_whole_prefix_with_bypass_identical_text(client, tools, first, openai_schema):
    second = ask(client, tools, "How many refunds were issued yesterday?")
    plain = ask(client, tools, "How many refunds were issued yesterday?",
                extra_headers={"X-Toolkv-Cache": "bypass"})
    openai_schema("CreateChatCompletionResponse", second.model_dump(exclude_unset=True))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 2000  # the system prompt and all 16 tool schemas
    assert second.usage.prompt_tokens - cached < 40  # only the user's turn was computed
    assert plain.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].message.content == plain.choices[0].message.content
    assert second.choices[0].message.content


def test_streamed_hit_equals_the_non_streamed_hit(client, tools, first, openai_schema):
    question = "Which channel sold the most this month?"
    whole = ask(client, tools, question)
    chunks = list(ask(client, tools, question, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        openai_schema("CreateChatCompletionStreamResponse", chunk.model_dump(exclude_unset=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    usage = chunks[-1].usage
    # the same question again: the whole group hits, and the question's own turn (about 17 tokens)
    # is computed in one chunk with its generation prompt (engine/prefix_index.py)
    assert usage.prompt_tokens - 24 < usage.prompt_tokens_details.cached_tokens
    assert whole.usage.prompt_tokens_details.cached_tokens > 2000


def test_the_parity_set_sent_at_once_equals_each_query_alone(client, tools, first):
    """Continuous batching on the real model: tau-bench retail's first parity queries sent 4 at a
    time (hits, batched together) give exactly what each gives alone, and a hit gives what a plain
    full prefill gives (one bypass: the module's others check the hit against a bypass with
    tool_choice `none`, `required` and a structured answer on this group; 8 at once, of several
    archs, on tiny models: tests/engine/test_batching.py)."""
    from concurrent.futures import ThreadPoolExecutor

    def run(query: str, **extra):
        response = ask(client, tools, query, tool_choice="auto", **extra)
        choice = response.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return choice.message.content, calls, choice.finish_reason, response.usage.prompt_tokens_details.cached_tokens

    queries = [q.query for q in RETAIL_QUERIES][:4]  # one batch of 4
    with ThreadPoolExecutor(max_workers=len(queries)) as pool:
        together = list(pool.map(run, queries))
    assert all(cached > 1000 for *_, cached in together)  # every one was a hit
    for query, batched in zip(queries, together, strict=True):
        assert batched[:3] == run(query)[:3], query  # alone (a hit too)
    plain = run(queries[0], extra_headers={"X-Toolkv-Cache": "bypass"})
    assert plain[3] == 0 and plain[:3] == together[0][:3]


def test_an_airline_agents_turns_compute_only_their_new_messages_with_bypass_identical_text(client):
    """A real tau-bench airline conversation's next turn (the agent's tool call and the tool's
    result added): the whole previous prompt is reused, and the answer equals a plain full
    prefill's. The agent's tools are the 6 of its 14 that the conversation calls (the other 8 are
    ~1,300 more tokens in each of its two full prefills). (Every turn of it, with every tool, on
    tiny models of three archs: tests/engine/test_conversation_reuse.py.)"""
    from tests.engine.test_conversation_reuse import TAU, tau_turns

    turns = tau_turns()
    called = {c["function"]["name"] for m in turns[-1] for c in m.get("tool_calls") or ()}
    tools = [t for t in json.loads((TAU / "tools_airline.json").read_text()) if t["function"]["name"] in called]
    assert len(tools) == 6

    def run(messages, **extra):
        return client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, tools=tools,
                                              temperature=0, max_tokens=24, **extra)

    first, second = turns[:2]
    assert second[-2].get("tool_calls") and second[-1]["role"] == "tool"
    previous = run(first).usage.prompt_tokens
    reused, plain = run(second), run(second, extra_headers={"X-Toolkv-Cache": "bypass"})
    assert reused.choices[0].message == plain.choices[0].message
    assert plain.usage.prompt_tokens_details.cached_tokens == 0
    assert reused.usage.prompt_tokens_details.cached_tokens == previous  # only the new messages computed


def test_forced_and_structured_requests_are_always_valid_and_the_cache_never_changes_them(client, tools, first,
                                                                                          openai_schema):
    """Issue 14's target on the real model: every `required` and named request is a call to a listed
    tool whose arguments validate against its schema (before the grammar: about a third), streamed
    or not; every structured answer validates; a hit equals a bypass with the grammar on."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}

    def run(query: str, tool_choice, **extra):
        return ask(client, tools, query, tool_choice, max_tokens=160, **extra)

    def check(calls, names):
        assert calls
        for call in calls:
            assert call.function.name in names
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])

    for row in RETAIL_QUERIES[:3]:
        named = {"type": "function", "function": {"name": row.expected_tool}}
        for choice in ("required", named):
            response = run(row.query, tool_choice=choice)
            openai_schema("CreateChatCompletionResponse", response.model_dump(mode="json", exclude_unset=True))
            assert response.choices[0].finish_reason == "tool_calls"
            check(response.choices[0].message.tool_calls, schemas if choice == "required" else {row.expected_tool})
    streamed = run(RETAIL_QUERIES[4].query, tool_choice="required", stream=True)
    content, names, arguments = "", {}, {}
    for chunk in streamed:
        openai_schema("CreateChatCompletionStreamResponse", chunk.model_dump(mode="json", exclude_unset=True))
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for part in choice.delta.tool_calls or ():
                if part.function.name:
                    names[part.index] = part.function.name
                arguments[part.index] = arguments.get(part.index, "") + (part.function.arguments or "")
    assert content == "" and names
    for index, name in names.items():
        jsonschema.validate(json.loads(arguments[index]), schemas[name])

    answer = {"type": "object", "properties": {"order_id": {"type": "string"},
                                               "action": {"enum": ["cancel", "return", "exchange"]}},
              "required": ["order_id", "action"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "intent", "schema": answer, "strict": True}}
    query = "I want to return order #W2378156."
    structured = [run(query, tool_choice="none", response_format=fmt, extra_headers=h) for h in
                  (None, {"X-Toolkv-Cache": "bypass"})]
    jsonschema.validate(json.loads(structured[0].choices[0].message.content), answer)
    assert structured[0].choices[0].message.content == structured[1].choices[0].message.content
    forced = [run(query, tool_choice="required", extra_headers=h) for h in (None, {"X-Toolkv-Cache": "bypass"})]
    assert [c.function for c in forced[0].choices[0].message.tool_calls] == \
        [c.function for c in forced[1].choices[0].message.tool_calls]
    assert forced[0].usage.prompt_tokens_details.cached_tokens > 1000
