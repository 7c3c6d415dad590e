"""Proxy mode against scripted upstreams, for what a real toolkv cannot be made to do on cue:
5xx and broken streams (retried before the first byte, an error event after it), 4xx passed
through, keys and tenants (the upstream key, cache_salt per tenant), the per-key quota and body
limit, tools in canonical order and usage asked of a stream then stripped, and hang-ups."""

from __future__ import annotations

import socket
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.edge.admission import _salt
from tests.proxy.conftest import (
    client_for,
    group_id,
    home_of,
    messages,
    metric,
    proxy,
    running,
    tools_of,
)
from tests.proxy.fake_upstream import Arrivals, FakeUpstream
from tests.support.waiting import wait_until

TOOLS = tools_of([("alpha", 5), ("bravo", 30), ("charlie", 15)])
CANONICAL = ["bravo", "charlie", "alpha"]  # largest schema first
SYSTEM = "You are scripted."


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages(SYSTEM, "hi"), "tools": TOOLS, **extra}


def post(live: Any, payload: dict[str, Any], key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(live.api_url + "/chat/completions", json=payload, headers=headers, timeout=60)


def sse(resp: httpx.Response) -> list[Any]:
    lines = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else orjson.loads(line) for line in lines]


def test_a_5xx_is_retried_on_the_other_upstream_and_a_4xx_is_passed_through(fakes):
    arrivals, upstreams = fakes
    home = home_of(upstreams, SYSTEM, TOOLS)
    other = next(u for u in upstreams if u is not home)
    with proxy(upstreams, upstream_down_s=0) as live:
        home.status = 500
        whole = post(live, body())
        streamed = post(live, body(stream=True))
        assert whole.json()["choices"][0]["message"]["content"] == f"from {other.name}"
        assert sse(streamed)[1]["choices"][0]["delta"]["content"] == f"from {other.name}"
        assert [a.upstream for a in arrivals.seen] == [home.name, other.name] * 2

        home.status = 429
        passed = post(live, body())
        assert passed.status_code == 429 and passed.json()["error"]["message"] == f"{home.name} says 429"
        assert len(arrivals.seen) == 5  # no retry

        home.status = other.status = 502
        failed = post(live, body())
        assert failed.status_code == 502
        error = failed.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "upstream_error")
        assert "status 502" in error["message"] and "127.0.0.1" not in error["message"]


def test_concurrent_requests_of_a_hot_group_fill_its_home_to_the_bound_then_share(fakes):
    """Four requests of one group at once, the bound at 2: two on its home, two on its second
    upstream, whatever order they reach the proxy in (each is counted as it is routed)."""
    arrivals, upstreams = fakes
    hold = threading.Event()
    for fake in upstreams:
        fake.hold = hold
    home = home_of(upstreams, SYSTEM, TOOLS)
    with proxy(upstreams, upstream_max_in_flight=2) as live, ThreadPoolExecutor(4) as pool:
        answers = [pool.submit(post, live, body()) for _ in range(4)]
        landed = sorted(a.upstream for a in arrivals.wait_for(4))
        hold.set()
        assert [answer.result().status_code for answer in answers] == [200] * 4
        assert landed == ["a", "a", "b", "b"]
        samples = live.metrics()
        assert metric(samples, "toolkv_upstream_routed_total", upstream=home.base_url, route="home") == 2
        assert metric(samples, "toolkv_upstream_routed_total", route="spill") == 2
        assert post(live, body()).json()["choices"][0]["message"]["content"] == f"from {home.name}"


def test_a_stream_broken_before_its_first_event_is_retried_and_after_it_ends_with_an_error(fakes):
    arrivals, upstreams = fakes
    home = home_of(upstreams, SYSTEM, TOOLS)
    other = next(u for u in upstreams if u is not home)
    with proxy(upstreams, upstream_down_s=0) as live:
        home.break_after, home.ping_first = 0, True  # headers and a comment: no event reached the client yet
        retried = sse(post(live, body(stream=True)))
        assert retried[1]["choices"][0]["delta"]["content"] == f"from {other.name}" and retried[-1] == "[DONE]"

        home.break_after, home.ping_first = 1, False  # the first event reached the client: no retry, an error ends it
        broken = sse(post(live, body(stream=True)))
        assert broken[0]["choices"][0]["delta"]["role"] == "assistant"
        assert broken[1]["error"]["code"] == "upstream_error" and broken[2] == "[DONE]" and len(broken) == 3
        assert [a.upstream for a in arrivals.seen] == [home.name, other.name, home.name]
        samples = live.metrics()
        assert metric(samples, "toolkv_requests_total", status="502", stream="true") == 1
        assert metric(samples, "toolkv_upstream_requests_total", upstream=home.base_url, status="broken") == 1
        with pytest.raises(openai.APIError, match="broke off"):  # what an SDK user sees
            list(client_for(live).chat.completions.create(**body(stream=True)))


def test_tools_go_upstream_in_canonical_order_and_usage_is_asked_of_a_stream_then_stripped(fakes):
    arrivals, upstreams = fakes
    for fake in upstreams:
        fake.cached_tokens = 40
    with proxy(upstreams) as live:
        events = sse(post(live, body(tools=TOOLS[::-1], stream=True)))
        sent = arrivals.seen[-1].body
        assert [t["function"]["name"] for t in sent["tools"]] == CANONICAL
        assert sent["stream_options"] == {"include_usage": True}
        assert all("usage" not in event for event in events[:-1]) and events[-1] == "[DONE]"
        samples = live.metrics()
        assert metric(samples, "toolkv_cache_lookups_total", result="hit") == 1
        assert metric(samples, "toolkv_prompt_tokens_cached_total") == 40
        asked = sse(post(live, body(stream=True, stream_options={"include_usage": True})))
        assert asked[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 40


def test_keys_are_required_and_upstreams_get_the_upstream_key_and_each_tenants_cache_salt(fakes):
    arrivals, upstreams = fakes
    shared_system = "A shared prompt."
    shared = group_id(shared_system, TOOLS)
    with proxy(upstreams, api_keys=("key-a", "key-b"), upstream_api_key="up-secret",
               upstream_cache_salt="tenant", shared_groups=(shared,)) as live:
        for key in (None, "wrong"):
            refused = post(live, body(), key)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(live.api_url + "/models", timeout=30).status_code == 401
        assert not arrivals.seen
        for key in ("key-a", "key-b"):
            assert post(live, body(cache_salt="mine"), key).status_code == 200
            assert post(live, body(messages=messages(shared_system, "hi")), key).status_code == 200
        own_a, shared_a, own_b, shared_b = arrivals.seen
        assert own_a.body["cache_salt"] == _salt(b"key-a") and own_b.body["cache_salt"] == _salt(b"key-b")
        assert "cache_salt" not in shared_a.body and "cache_salt" not in shared_b.body
        # a toolkv upstream's namespace is the tenant's own, for a shared group too (its conversation
        # records and stored responses are the tenant's; the upstream's shared_groups share the group)
        assert own_a.headers["x-toolkv-tenant"] == shared_a.headers["x-toolkv-tenant"] == _salt(b"key-a")
        assert own_b.headers["x-toolkv-tenant"] == shared_b.headers["x-toolkv-tenant"] == _salt(b"key-b")
        assert shared_a.upstream == shared_b.upstream == home_of(upstreams, shared_system, TOOLS).name
        assert own_a.upstream == home_of(upstreams, SYSTEM, TOOLS, salt=_salt(b"key-a")).name
        assert {a.headers["authorization"] for a in arrivals.seen} == {"Bearer up-secret"}
        models = client_for(live, "key-a").models.list().data
        assert sorted(m.id for m in models) == ["model-a", "model-b"]


def test_an_open_proxy_passes_the_clients_key_on_and_salts_nothing(fakes):
    arrivals, upstreams = fakes
    with proxy(upstreams, upstream_cache_salt="tenant") as live:
        assert post(live, body(), "client-key").status_code == 200
        assert arrivals.seen[0].headers["authorization"] == "Bearer client-key"
        assert "cache_salt" not in arrivals.seen[0].body and "x-toolkv-tenant" not in arrivals.seen[0].headers


def test_the_per_key_quota_and_the_body_limit_hold(fakes):
    arrivals, upstreams = fakes
    hold = threading.Event()
    for fake in upstreams:
        fake.hold = hold
    with proxy(upstreams, api_keys=("k1", "k2"), max_requests_per_key=1, max_request_bytes=2048) as live, \
            ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, live, body(), "k1")
        arrivals.wait_for(1)  # k1's one slot is taken until the upstream answers
        refused = post(live, body(), "k1")
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_requests_for_key"
        other_key = pool.submit(post, live, body(), "k2")
        arrivals.wait_for(2)
        hold.set()
        assert first.result().status_code == other_key.result().status_code == 200
        too_big = post(live, body(messages=messages(SYSTEM, "x" * 4096)), "k1")
        assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
        assert len(arrivals.seen) == 2


def test_a_client_that_hangs_up_before_the_answer_is_counted_and_frees_its_upstream(fakes):
    arrivals, upstreams = fakes
    hold = threading.Event()
    for fake in upstreams:
        fake.hold = hold
    with proxy(upstreams) as live:
        payload = orjson.dumps(body())
        port = int(live.base_url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (port, len(payload), payload))
            arrivals.wait_for(1)
        assert wait_until(lambda: metric(live.metrics(), "toolkv_requests_total", status="499") == 1)
        samples = live.metrics()
        assert metric(samples, "toolkv_upstream_in_flight") == 0 and metric(samples, "toolkv_requests_in_flight") == 0
        hold.set()


def test_an_upstream_like_llama_cpp_pythons_server_serves_and_counts_as_up():
    """llama-cpp-python's server has no /health (404) and answers a bare 400 to a request whose
    X-Request-Id is not a UUID: the proxy's probe takes a 404 as reachable, and its ids are UUIDs."""
    arrivals = Arrivals()
    fake = FakeUpstream("llama", arrivals)
    with running(fake.app) as served:  # ready as the test servers are, then it turns into the peer
        fake.base_url, fake.like_llama_cpp_python = served.base_url, True
        with proxy([fake], upstream_probe_s=0.05) as live:
            resp = post(live, body())
            assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "from llama"
            [arrival] = arrivals.wait_for(1)
            assert uuid.UUID(arrival.headers["x-request-id"]).version == 4
            health = httpx.get(live.base_url + "/health", timeout=30).json()
            assert health["status"] == "ok" and health["upstreams"][0]["status"] == "ok"
            assert metric(live.metrics(), "toolkv_upstream_up", upstream=fake.base_url) == 1
