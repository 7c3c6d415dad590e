"""The proxy's background watch (`upstream_probe_s`): an upstream that stops answering is seen
gone by its probe, before any request finds out, and its groups go to the other upstream at once
(no request waits on it or fails on it first)."""

from __future__ import annotations

from tests.proxy.conftest import client_for, home_of, messages, metric, proxy, tools_of
from tests.proxy.test_failover import MODEL, grew
from tests.support.waiting import wait_until

TOOLS = tools_of([("tickets", 20), ("refunds", 9)])
SYSTEM = "You answer support tickets."


def test_a_stopped_upstream_is_routed_around_before_a_request_meets_it(toolkv_upstreams):
    home = home_of(toolkv_upstreams, SYSTEM, TOOLS)
    other = next(u for u in toolkv_upstreams if u is not home)
    with proxy(toolkv_upstreams, upstream_probe_s=0.2) as live:
        client = client_for(live)

        def ask(question: str) -> int:
            answer = client.chat.completions.create(model=MODEL, messages=messages(SYSTEM, question), tools=TOOLS,
                                                    tool_choice="none", temperature=0, max_tokens=3)
            return int(answer.usage.prompt_tokens_details.cached_tokens)

        assert ask("first") == 0
        assert metric(live.metrics(), "toolkv_upstream_up", upstream=home.base_url) == 1
        home.stop()
        assert wait_until(lambda: metric(live.metrics(), "toolkv_upstream_up", upstream=home.base_url) == 0)
        before = live.metrics()
        assert ask("second") == 0  # its group compiles on the other upstream: a miss, then hits
        assert ask("third") > 0 and ask("fourth") > 0
        after = live.metrics()
        assert grew(after, before, "toolkv_upstream_routed_total", upstream=other.base_url, route="failover") == 3
        assert grew(after, before, "toolkv_upstream_requests_total", upstream=home.base_url) == 0  # never tried
        assert grew(after, before, "toolkv_requests_total", status="200") == 3
