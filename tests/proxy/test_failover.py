"""Proxy mode when real toolkv upstreams die: a request not yet streamed is retried on the other
upstream and succeeds (its group moves there: a miss, then hits), and with every upstream gone
the client gets a 503 in OpenAI's envelope, /health says so, and nothing hangs."""

from __future__ import annotations

import httpx

from tests.proxy.conftest import MODEL, client_for, home_of, messages, metric, proxy, tools_of

TOOLS = tools_of([("flights", 25), ("seats", 10), ("bags", 18)])
SYSTEM = "You rebook flights."


def ask(client, question: str, **extra):
    return client.chat.completions.create(model=MODEL, messages=messages(SYSTEM, question), tools=TOOLS,
                                          tool_choice="none", temperature=0, max_tokens=3, **extra)


def grew(after: dict[str, float], before: dict[str, float], name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def test_a_dead_upstreams_requests_go_to_the_other_until_none_is_left(toolkv_upstreams):
    home = home_of(toolkv_upstreams, SYSTEM, TOOLS)
    other = next(u for u in toolkv_upstreams if u is not home)
    with proxy(toolkv_upstreams, upstream_down_s=600) as live:
        client = client_for(live)
        assert ask(client, "first").usage.prompt_tokens_details.cached_tokens == 0  # compiled on its home
        home.stop()
        before = live.metrics()
        moved = ask(client, "second")  # the home refuses: retried on the other, which has not seen the group
        chunks = list(ask(client, "third", stream=True, stream_options={"include_usage": True}))
        after = live.metrics()
        assert moved.usage.prompt_tokens_details.cached_tokens == 0
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the other holds the group now
        assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)
        assert grew(after, before, "toolkv_upstream_routed_total", upstream=home.base_url, route="home") == 1
        assert grew(after, before, "toolkv_upstream_routed_total", upstream=other.base_url, route="retry") == 1
        # believed down from then on: the stream went to the other first, without trying the home
        assert grew(after, before, "toolkv_upstream_routed_total", upstream=other.base_url, route="failover") == 1
        assert grew(after, before, "toolkv_upstream_requests_total", upstream=home.base_url, status="error") == 1
        assert grew(after, before, "toolkv_requests_total", status="200") == 2
        assert metric(after, "toolkv_upstream_up", upstream=home.base_url) == 0

        health = httpx.get(live.base_url + "/health", timeout=30)
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert {u["url"]: u["status"] for u in health.json()["upstreams"]} == {home.base_url: "unreachable",
                                                                             other.base_url: "ok"}
        other.stop()
        body = {"model": MODEL, "messages": messages(SYSTEM, "anyone?"), "max_tokens": 2}
        for stream in (False, True):
            resp = httpx.post(live.api_url + "/chat/completions", json={**body, "stream": stream}, timeout=30)
            assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
            error = resp.json()["error"]
            assert (error["type"], error["code"]) == ("server_error", "upstream_unavailable")
            assert "127.0.0.1" not in error["message"]  # upstreams are not named to clients
        assert httpx.get(live.base_url + "/health", timeout=30).json()["status"] == "failed"
        assert httpx.get(live.api_url + "/models", timeout=30).status_code == 503
        assert metric(live.metrics(), "toolkv_requests_total", status="503") == 2
