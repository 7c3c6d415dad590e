"""Anthropic's Messages API (`/v1/messages`) through the proxy, with the real `anthropic` SDK: a tool
group goes to its home upstream and hits there from its second request on (whole and streamed),
the equivalent chat request (the `openai` SDK) goes to the same upstream and shares its prefix,
`prompt_cache_key` routes as chat's does, the proxy's hits and misses count Messages usage, keys
sent as `x-api-key` are taken, errors are Anthropic's (the proxy's own and an upstream's), a
stream broken off after its first event ends with Anthropic's error event, and one broken before
it is retried on the other upstream."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.proxy.conftest import (
    MODEL,
    Running,
    client_for,
    home_of,
    messages,
    metric,
    proxy,
    tools_of,
)
from tests.proxy.fake_upstream import Arrivals
from tests.proxy.test_cache_key import home_of_key, served, systems_on_both

TOOLS = tools_of([("orders", 14), ("refunds", 6)])
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def proxied(toolkv_upstreams: list[Running]) -> Iterator[Running]:
    with proxy(toolkv_upstreams, max_tools=4) as live:
        yield live


def sdk(live: Running, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.base_url, api_key=key, max_retries=0, timeout=120)


def ask(client: anthropic.Anthropic, system: str, question: str, **extra: Any) -> Any:
    return client.messages.create(model=MODEL, max_tokens=3, system=system, tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
                                  tool_choice={"type": "none"}, messages=[{"role": "user", "content": question}],
                                  **extra)


def test_a_messages_group_goes_home_and_hits_there_whole_and_streamed(proxied, toolkv_upstreams):
    client = sdk(proxied)
    system = "You are the Messages desk of shop 1."
    home = home_of(toolkv_upstreams, system, TOOLS).base_url
    first: list[Any] = []
    assert served(proxied, toolkv_upstreams, lambda: first.append(ask(client, system, "Hi"))) == [home]
    assert first[0].usage.cache_read_input_tokens == 0 and first[0].usage.cache_creation_input_tokens > 0
    again: list[Any] = []
    assert served(proxied, toolkv_upstreams, lambda: again.append(ask(client, system, "Hello"))) == [home]
    assert again[0].usage.cache_read_input_tokens == first[0].usage.cache_creation_input_tokens

    def stream() -> None:
        with client.messages.stream(model=MODEL, max_tokens=3, system=system, tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
                                    tool_choice={"type": "none"},
                                    messages=[{"role": "user", "content": "Hey"}]) as events:
            names = [event.type for event in events]
            again.append((names, events.get_final_message()))

    assert served(proxied, toolkv_upstreams, stream) == [home]
    names, final = again[1]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert final.usage.cache_read_input_tokens == first[0].usage.cache_creation_input_tokens
    samples = proxied.metrics()
    assert metric(samples, "toolkv_cache_lookups_total", upstream=home, result="hit") >= 2
    assert metric(samples, "toolkv_cache_lookups_total", result="unknown") == 0


def test_the_equivalent_chat_request_goes_to_the_same_upstream_and_shares_the_prefix(proxied, toolkv_upstreams):
    for home, system in systems_on_both(toolkv_upstreams, TOOLS).items():  # a group homed on each upstream
        written = ask(sdk(proxied), system, "Hi").usage.cache_creation_input_tokens
        chat: list[Any] = []

        def send(system: str = system, chat: list[Any] = chat) -> None:
            chat.append(client_for(proxied).chat.completions.create(
                model=MODEL, messages=messages(system, "Hello"), tools=TOOLS, tool_choice="none", max_tokens=3))

        assert served(proxied, toolkv_upstreams, send) == [home]
        assert chat[0].usage.prompt_tokens_details.cached_tokens == written > 0


def test_a_prompt_cache_key_routes_a_messages_request_as_it_routes_chat(proxied, toolkv_upstreams):
    key = "conversation-7"
    home = home_of_key(toolkv_upstreams, key).base_url
    for system in systems_on_both(toolkv_upstreams, TOOLS).values():
        send = lambda: ask(sdk(proxied), system, "Hi", extra_body={"prompt_cache_key": key})  # noqa: B023, E731
        assert served(proxied, toolkv_upstreams, send) == [home]


def test_errors_are_anthropics_the_proxys_own_and_an_upstreams(proxied):
    client = sdk(proxied)
    many = [{**ANTHROPIC_TOOLS[0], "name": f"tool_{n}"} for n in range(5)]
    with pytest.raises(anthropic.BadRequestError) as own:  # max_tools, checked by the proxy
        client.messages.create(model=MODEL, max_tokens=3, tools=many, messages=[{"role": "user", "content": "Hi"}])
    assert own.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                         "message": "5 tools; the limit is 4"}}
    with pytest.raises(anthropic.BadRequestError) as upstream:  # refused by the upstream, passed on
        client.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hi"}],
                               extra_body={"top_k": 5})  # the SDK (2.x) has no sampling arguments
    assert upstream.value.body["type"] == "error" and "top_k" in upstream.value.body["error"]["message"]


def test_a_key_sent_as_x_api_key_is_taken_and_a_wrong_one_is_a_401(toolkv_upstreams):
    with proxy(toolkv_upstreams, api_keys=("client-key",)) as keyed:
        answer = ask(sdk(keyed, "client-key"), "You are the keyed desk.", "Hi")
        assert answer.type == "message" and answer.usage.input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError):
            ask(sdk(keyed, "wrong-key"), "You are the keyed desk.", "Hi")


def stream_events(live: Running) -> list[tuple[str, str]]:
    """A streamed Messages request's (event name, data) pairs as the client receives them."""
    body = {"model": MODEL, "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.stream("POST", live.api_url + "/messages", json=body, timeout=60,
                      headers={"anthropic-version": "2023-06-01"}) as resp:
        assert resp.status_code == 200, resp.read()
        text = "".join(resp.iter_text())
    blocks = [block.splitlines() for block in text.split("\n\n") if block.strip()]
    return [(lines[0].removeprefix("event: "), lines[1].removeprefix("data: ")) for lines in blocks]


def test_a_stream_broken_after_its_first_event_ends_with_anthropics_error_event(
        fakes: tuple[Arrivals, list[Any]]) -> None:
    arrivals, upstreams = fakes
    for fake in upstreams:
        fake.break_after = 2
    with proxy(upstreams) as live:
        events = stream_events(live)
        with pytest.raises(anthropic.APIStatusError, match="broke off"), \
                sdk(live).messages.stream(model=MODEL, max_tokens=3,
                                          messages=[{"role": "user", "content": "Hi"}]) as stream:
            stream.until_done()  # the SDK raises the error event
    assert [name for name, _ in events] == ["message_start", "content_block_start", "error"]
    assert '"type":"error"' in events[-1][1] and '"type":"api_error"' in events[-1][1]
    assert arrivals.seen[0].headers["anthropic-version"] == "2023-06-01"  # passed on


def test_a_stream_that_fails_before_its_first_event_is_retried_on_the_other_upstream(
        fakes: tuple[Arrivals, list[Any]]) -> None:
    arrivals, upstreams = fakes
    upstreams[0].status = upstreams[1].status = 503
    with proxy(upstreams) as live:
        with pytest.raises(anthropic.APIStatusError) as failed:
            sdk(live).messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hi"}],
                                      stream=True)
        assert failed.value.status_code == 502 and failed.value.body["type"] == "error"
        home = home_of(upstreams, None, [])  # the group of a request without system and tools
        other = next(fake for fake in upstreams if fake is not home)
        home.status, other.status = 503, 200
        with sdk(live).messages.stream(model=MODEL, max_tokens=3,
                                       messages=[{"role": "user", "content": "Hi"}]) as stream:
            text = stream.get_final_text()
    assert text == f"from {other.name}"
    assert [a.upstream for a in arrivals.seen[2:]] == [home.name, other.name]
