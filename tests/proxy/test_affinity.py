"""Proxy mode in front of two real toolkv servers (tiny random-weight models, each its own cache),
through the `openai` SDK: a tool group lives on one upstream whatever order its tools come in,
groups spread over both, streams pass through unchanged, the proxy's hit/miss metrics are the
upstreams', and a hot group spreads to its second upstream past the in-flight bound."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from adapters.base import ToolGroup, ToolSpec
from gateway.proxy.routing import AffinityRouter, affinity_key
from tests.proxy.conftest import (
    MODEL,
    Running,
    client_for,
    group_id,
    home_of,
    messages,
    metric,
    proxy,
    scrape,
    tools_of,
)
from tests.support.waiting import wait_until

TOOLS = tools_of([("orders", 30), ("refunds", 12), ("inventory", 20), ("customers", 8), ("shipping", 16)])


@pytest.fixture(scope="module")
def proxied(toolkv_upstreams: list[Running]) -> Iterator[Running]:
    with proxy(toolkv_upstreams) as live:
        yield live


def cached_groups(upstream: Running) -> dict[str, dict[str, Any]]:
    entries = httpx.get(upstream.api_url + "/cache", timeout=30).json()["data"]
    return {entry["group_id"]: entry for entry in entries}


def shuffled(tools: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    out = list(tools)
    random.Random(seed).shuffle(out)
    return out


def test_a_group_lives_on_one_upstream_whatever_its_tool_order_and_groups_spread(proxied, toolkv_upstreams):
    client = client_for(proxied)
    systems = [f"You are the assistant of shop {n}." for n in range(16)]
    for n, system in enumerate(systems):
        for turn in range(3):
            resp = client.chat.completions.create(model=MODEL, messages=messages(system, f"question {turn}"),
                                                  tools=shuffled(TOOLS, n * 3 + turn), tool_choice="none",
                                                  temperature=0, max_tokens=2)
            cached = resp.usage.prompt_tokens_details.cached_tokens
            assert (cached > 0) == (turn > 0)  # the upstream's own prefix cache hits every later turn
    holders = [cached_groups(upstream) for upstream in toolkv_upstreams]
    router = AffinityRouter([u.base_url for u in toolkv_upstreams], max_in_flight=16)
    for system in systems:
        gid = group_id(system, TOOLS)
        where = [n for n, held in enumerate(holders) if gid in held]
        assert len(where) == 1  # compiled once, on one upstream: the router's home for it
        assert toolkv_upstreams[where[0]].base_url == router.ranking(affinity_key("", gid))[0]
        assert holders[where[0]][gid]["hits"] == 2
    assert all(holders)  # 16 groups: both upstreams hold some (all on one: 2 in 65,536)


def test_tools_in_another_order_hit_the_upstream_prefix_the_first_order_compiled(proxied):
    client = client_for(proxied)
    system = "You answer questions about parcels."
    first = client.chat.completions.create(model=MODEL, messages=messages(system, "Where is it?"), tools=TOOLS,
                                           tool_choice="none", temperature=0, max_tokens=2)
    second = client.chat.completions.create(model=MODEL, messages=messages(system, "When?"), tools=TOOLS[::-1],
                                            tool_choice="none", temperature=0, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def canonical(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    order = [t.name for t in ToolGroup.of(None, [ToolSpec(t["function"]["name"], t["function"]["description"],
                                                          t["function"]["parameters"]) for t in tools]).tools]
    return sorted(tools, key=lambda t: order.index(t["function"]["name"]))


def raw_stream(url: str, body: dict[str, Any]) -> list[bytes]:
    """The events of a stream, as the bytes arrived (cut at blank lines)."""
    with httpx.stream("POST", url + "/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        data = b"".join(resp.iter_raw())
    return [event + b"\n\n" for event in data.split(b"\n\n") if event]


def normalised(events: list[bytes]) -> list[bytes]:
    """Without what differs between two runs of one request: its id and creation time."""
    return [re.sub(rb'"created":\d+', b'"created":0', re.sub(rb'"id":"chatcmpl-[0-9a-f]+"', b'"id":""', e))
            for e in events]


@pytest.mark.parametrize("include_usage", [True, False])
def test_a_stream_passes_through_unchanged(proxied, toolkv_upstreams, include_usage):
    system = f"You stream answers ({include_usage})."
    body = {"model": MODEL, "messages": messages(system, "Tell me."), "tools": canonical(TOOLS), "tool_choice": "none",
            "temperature": 0, "max_tokens": 12, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    home = home_of(toolkv_upstreams, system, TOOLS)
    for _ in range(2):  # the group, then this very prompt, are cached from here on: every run below is alike
        raw_stream(home.api_url, body)
    direct = raw_stream(home.api_url, body)
    through = raw_stream(proxied.api_url, {**body, "tools": shuffled(TOOLS, 7)})
    assert normalised(through) == normalised(direct)
    assert through[-1] == b"data: [DONE]\n\n" and len(through) > 4
    assert (b'"usage"' in through[-2]) == include_usage


def test_hit_and_miss_metrics_are_the_upstreams_cached_tokens(proxied, toolkv_upstreams):
    client = client_for(proxied)
    system = "You count tokens."
    home = home_of(toolkv_upstreams, system, TOOLS)
    before, home_before = scrape(proxied.base_url), home.metrics()
    miss = client.chat.completions.create(model=MODEL, messages=messages(system, "a"), tools=TOOLS,
                                          tool_choice="none", temperature=0, max_tokens=2)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=messages(system, "b"), tools=TOOLS[::-1], tool_choice="none", temperature=0,
        max_tokens=2, stream=True) if c.choices)  # no usage asked: the proxy reads the upstream's anyway
    assert miss.usage.prompt_tokens_details.cached_tokens == 0 and text is not None
    after, home_after = scrape(proxied.base_url), home.metrics()

    def grew(samples_after, samples_before, name, **labels):
        return metric(samples_after, name, **labels) - metric(samples_before, name, **labels)

    where = {"upstream": home.base_url}
    assert grew(after, before, "toolkv_cache_lookups_total", result="miss", **where) == 1
    assert grew(after, before, "toolkv_cache_lookups_total", result="hit", **where) == 1
    assert grew(after, before, "toolkv_time_to_first_token_seconds_count", cache="hit", **where) == 1
    for name in ("toolkv_prompt_tokens_cached_total", "toolkv_prompt_tokens_total"):
        assert grew(after, before, name, **where) == grew(home_after, home_before, name) > 0


def test_the_sdk_runs_responses_and_text_completions_through_the_proxy(proxied):
    client = client_for(proxied)
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    first = client.responses.create(model=MODEL, instructions="You respond.", input="hi", tools=flat,
                                    tool_choice="none", temperature=0, max_output_tokens=4)
    streamed = list(client.responses.create(model=MODEL, instructions="You respond.", input="again",
                                            tools=flat[::-1], tool_choice="none", temperature=0,
                                            max_output_tokens=4, stream=True))
    assert first.usage.input_tokens_details.cached_tokens == 0
    done = streamed[-1]
    assert done.type == "response.incomplete" and done.response.usage.input_tokens_details.cached_tokens > 0
    text = "".join(c.choices[0].text for c in client.completions.create(model=MODEL, prompt="Once upon a time",
                                                                         max_tokens=4, temperature=0, stream=True))
    assert text
    assert metric(scrape(proxied.base_url), "toolkv_requests_total", status="200", stream="true") >= 2


def test_health_lists_the_upstreams_and_models_lists_their_models_once(proxied, toolkv_upstreams):
    health = httpx.get(proxied.base_url + "/health", timeout=30)
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    assert [u["url"] for u in health.json()["upstreams"]] == [u.base_url for u in toolkv_upstreams]
    assert [m.id for m in client_for(proxied).models.list().data] == [MODEL]
    assert client_for(proxied).models.retrieve(MODEL).id == MODEL


def first_event(resp: httpx.Response) -> Iterator[str]:
    """Wait for the stream's first event; keep the returned lines while the stream should stay
    open (a line iterator that is dropped closes its connection)."""
    lines = resp.iter_lines()
    assert next(line for line in lines if line.startswith("data: "))
    return lines


def test_a_hot_group_over_the_bound_spreads_to_its_second_upstream(toolkv_upstreams):
    """Two streams of one group, the proxy's bound at 1: the second goes to the group's second
    upstream. Both clients then hang up, which ends both generations upstream."""
    system = "You are very popular."
    body = {"model": MODEL, "messages": messages(system, "Write a long story."), "tools": TOOLS,
            "tool_choice": "none", "temperature": 0, "max_tokens": 3000, "stream": True}
    engines = [u.app.state.gateway.model.runtime.engine for u in toolkv_upstreams]
    cancelled = [engine.num_cancelled for engine in engines]
    with proxy(toolkv_upstreams, upstream_max_in_flight=1) as live:
        url = live.api_url + "/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=120) as first:
            first_lines = first_event(first)  # in flight on its home until the stream ends
            with httpx.stream("POST", url, json=body, timeout=120) as second:
                second_lines = first_event(second)
                samples = live.metrics()
                upstream_loads = [metric(u.metrics(), "toolkv_requests_in_flight") for u in toolkv_upstreams]
        del first_lines, second_lines
        assert metric(samples, "toolkv_upstream_routed_total", route="home") == 1
        assert metric(samples, "toolkv_upstream_routed_total", route="spill") == 1
        assert upstream_loads == [1, 1]  # one stream on each: the upstreams' own count
        assert wait_until(lambda: [e.num_cancelled for e in engines] == [c + 1 for c in cancelled])
        assert wait_until(lambda: metric(live.metrics(), "toolkv_requests_total", status="499", stream="true") == 2)
        assert metric(live.metrics(), "toolkv_upstream_in_flight") == 0
