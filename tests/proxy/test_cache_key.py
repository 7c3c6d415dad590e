"""`prompt_cache_key` through the proxy, in front of two real toolkv servers, with the `openai` SDK:
requests that share a key go to one upstream whatever their tool group (chat, completions and
Responses alike; each upstream accepts the field), and without a key each group goes home."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gateway.proxy.routing import AffinityRouter, cache_key_affinity
from tests.proxy.conftest import MODEL, Running, client_for, home_of, messages, metric, proxy, tools_of

TOOLS = tools_of([("orders", 12), ("refunds", 6)])


@pytest.fixture(scope="module")
def proxied(toolkv_upstreams: list[Running]) -> Iterator[Running]:
    with proxy(toolkv_upstreams) as live:
        yield live


def home_of_key(upstreams: list[Running], key: str, salt: str = "") -> Running:
    ranked = AffinityRouter([u.base_url for u in upstreams], 1).ranking(cache_key_affinity(salt, key))
    return next(u for u in upstreams if u.base_url == ranked[0])


def systems_on_both(upstreams: list[Running], tools: list[dict[str, Any]] = TOOLS) -> dict[str, str]:
    """A system prompt whose group (with `tools`) lives on each upstream (by base url)."""
    found: dict[str, str] = {}
    for n in range(64):
        system = f"You are the assistant of shop {n}."
        found.setdefault(home_of(upstreams, system, tools).base_url, system)
    assert len(found) == len(upstreams)
    return found


def served(proxied: Running, upstreams: list[Running], send: Any) -> list[str]:
    """The upstreams (base urls) that answered what `send()` sent through the proxy."""
    def answered() -> dict[str, float]:
        samples = proxied.metrics()
        return {u.base_url: metric(samples, "toolkv_upstream_requests_total", upstream=u.base_url) for u in upstreams}

    before = answered()
    send()
    after = answered()
    return [url for url in after if after[url] > before[url]]


def test_requests_sharing_a_prompt_cache_key_share_an_upstream_whatever_their_group(proxied, toolkv_upstreams):
    client = client_for(proxied)
    key = "conversation-42"
    home = home_of_key(toolkv_upstreams, key).base_url
    systems = systems_on_both(toolkv_upstreams)

    def chat(system: str, **extra: Any) -> None:
        client.chat.completions.create(model=MODEL, messages=messages(system, "Hi"), tools=TOOLS,
                                       tool_choice="none", temperature=0, max_tokens=2, **extra)

    for system in systems.values():  # one group on each upstream: both go to the key's
        assert served(proxied, toolkv_upstreams, lambda s=system: chat(s, prompt_cache_key=key)) == [home]
    away = next(url for url in systems if url != home)
    assert served(proxied, toolkv_upstreams, lambda: chat(systems[away])) == [away]  # no key: its group's home

    def complete() -> None:
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2,
                                  extra_body={"prompt_cache_key": key})

    def respond() -> None:
        client.responses.create(model=MODEL, instructions=systems[away], input="Hi", max_output_tokens=2,
                                prompt_cache_key=key)

    assert served(proxied, toolkv_upstreams, complete) == [home]
    assert served(proxied, toolkv_upstreams, respond) == [home]


def test_two_keys_for_one_group_may_live_on_two_upstreams(proxied, toolkv_upstreams):
    """A key picks the upstream, so one group's requests under keys with different homes are
    answered on both (the client asked to keep each key's requests together, not the group's)."""
    client = client_for(proxied)
    keys = {home_of_key(toolkv_upstreams, f"user-{n}").base_url: f"user-{n}" for n in range(64)}
    assert len(keys) == 2
    for url, key in keys.items():
        assert served(proxied, toolkv_upstreams, lambda k=key: client.chat.completions.create(
            model=MODEL, messages=messages("One shared prompt.", "Hi"), tools=TOOLS, tool_choice="none",
            temperature=0, max_tokens=2, prompt_cache_key=k)) == [url]
