"""The fleet view in proxy mode, in front of two real toolkv servers (tiny random-weight models, each
its own cache): the proxy lists every upstream's cache entries naming the upstream, merges their
Prometheus series under an `upstream` label at `/metrics/fleet` (its own `/metrics` unchanged),
and serves the dashboard over them; an upstream that is gone is named, one without toolkv's cache
API (vLLM's 404) is left out. One proxy for the first tests; each measures from fresh upstreams."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.api.dashboard import STATIC_DIR
from tests.proxy.conftest import MODEL, Running, client_for, home_of, messages, metric, proxy, running, scrape, tools_of
from tests.proxy.fake_upstream import Arrivals, FakeUpstream

SLOW_MACHINE_S = 30.0  # the view's bound on each upstream's answer: a busy test machine is not a gone upstream
TOOLS = tools_of([("fleet_orders", 20), ("fleet_refunds", 10)])


@pytest.fixture(scope="module")
def proxied(toolkv_upstreams: list[Running]) -> Iterator[Running]:
    with proxy(toolkv_upstreams, upstream_connect_timeout_s=SLOW_MACHINE_S) as live:
        yield live


@pytest.fixture(scope="module")
def homes(proxied: Running, toolkv_upstreams: list[Running]) -> dict[str, str]:
    """One group homed on each upstream, asked twice through the proxy (a miss, then a hit):
    upstream URL -> the group's system prompt."""
    found: dict[str, str] = {}
    for n in range(64):
        system = f"You are the fleet desk {n}."
        found.setdefault(home_of(toolkv_upstreams, system, TOOLS).base_url, system)
    assert len(found) == len(toolkv_upstreams)
    client = client_for(proxied)
    for system in found.values():
        for turn in range(2):
            client.chat.completions.create(model=MODEL, messages=messages(system, f"question {turn}"), tools=TOOLS,
                                           tool_choice="none", temperature=0, max_tokens=2)
    return found


def get(live: Running, path: str) -> Any:
    resp = httpx.get(live.base_url + path, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_the_cache_listing_names_the_upstream_of_every_entry(proxied, toolkv_upstreams, homes):
    listed = get(proxied, "/v1/cache")
    on_each = {(entry["id"], upstream.base_url) for upstream in toolkv_upstreams
               for entry in get(upstream, "/v1/cache")["data"]}
    assert {(entry["id"], entry["upstream"]) for entry in listed["data"]} == on_each
    assert "unavailable_upstreams" not in listed
    for url in homes:  # each group where the proxy sent it
        assert any(e["upstream"] == url and "ram" in e["tiers"] for e in listed["data"])
    entry = listed["data"][0]
    one = get(proxied, f"/v1/cache/{entry['id']}")
    assert one["id"] == entry["id"] and one["upstreams"] == [entry["upstream"]]


def test_the_merged_metrics_are_each_upstreams_own_labelled_and_the_proxys_stay(proxied, toolkv_upstreams, homes):
    fleet = scrape(proxied.base_url, "/metrics/fleet")
    for upstream in toolkv_upstreams:
        own = upstream.metrics()
        for result in ("hit", "miss"):
            assert metric(own, "toolkv_cache_lookups_total", result=result) == 1, result  # its one group
            assert metric(fleet, "toolkv_cache_lookups_total", result=result, upstream=upstream.base_url) == 1
    assert metric(fleet, "toolkv_proxy_requests_total", status="200") == 4  # the proxy's, renamed: not twice
    assert metric(fleet, "toolkv_upstream_routed_total", route="home") == 4  # its routing series, as they are
    mine = proxied.metrics()
    assert metric(mine, "toolkv_requests_total", status="200") == 4  # /metrics: the proxy's own series
    assert metric(mine, "toolkv_cache_lookups_total", result="hit") == 2


def test_the_dashboard_shows_a_row_per_upstream_and_the_fleets_totals(proxied, toolkv_upstreams, homes):
    page = httpx.get(proxied.base_url + "/", timeout=30)
    assert page.status_code == 200 and 'id="replicas"' in page.text
    assert httpx.get(proxied.base_url + "/static/dashboard.js").content == (STATIC_DIR / "dashboard.js").read_bytes()
    stats = get(proxied, "/v1/dashboard/stats")
    assert stats["status"] == "ok" and stats["mode"] == "proxy" and stats["model"] == MODEL
    rows = {row["name"]: row for row in stats["replicas"]}
    assert list(rows) == [u.base_url for u in toolkv_upstreams]
    for row in rows.values():
        assert (row["status"], row["in_flight"], row["lookups"]) == ("ok", 0, {"hit": 1.0, "miss": 1.0})
    assert stats["totals"]["requests"] == 4 and stats["totals"]["lookups"] == {"hit": 2.0, "miss": 2.0}
    assert {g["replica"] for g in stats["groups"]} == set(homes)


def test_an_upstream_gone_is_named_and_one_without_a_cache_api_is_left_out(toolkv_upstreams, fakes):
    first, _ = toolkv_upstreams
    _, (vllm_like, _) = fakes
    with (running(FakeUpstream("gone", Arrivals()).app) as gone,
          proxy([first, vllm_like, gone], upstream_connect_timeout_s=SLOW_MACHINE_S) as live):
        gone.stop()  # its port now refuses connections
        listed = get(live, "/v1/cache")
        assert {entry["upstream"] for entry in listed["data"]} == {first.base_url}
        assert listed["unavailable_upstreams"] == [gone.base_url]
        cleared = httpx.delete(live.base_url + "/v1/cache", timeout=60)
        assert cleared.status_code == 503 and gone.base_url in cleared.json()["error"]["message"]
        health = get(live, "/health")
        assert health["status"] == "degraded"
        assert [(u["url"], u["status"]) for u in health["upstreams"]] == [
            (first.base_url, "ok"), (vllm_like.base_url, "ok"), (gone.base_url, "unreachable")]


def test_an_upstream_answer_over_the_cap_is_left_out_unread(toolkv_upstreams):
    first, _ = toolkv_upstreams
    assert len(httpx.get(first.base_url + "/metrics", timeout=30).content) > 1024
    with proxy([first], upstream_max_body_bytes=1024) as live:
        fleet = scrape(live.base_url, "/metrics/fleet")
        assert "toolkv_proxy_requests_in_flight" in fleet  # the proxy's own, renamed
        assert not [name for name in fleet if f'upstream="{first.base_url}"' in name
                    and not name.startswith("toolkv_upstream_")]  # nothing of the upstream's own
