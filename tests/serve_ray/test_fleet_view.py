"""What an operator sees of `toolkv serve --replicas 2` at the ingress: `/health` names each replica;
the dashboard (page and stats) shows the fleet's totals and a row per replica that agree with the
replicas' own metrics; deleting a cache entry or clearing the cache through the ingress takes it
off every replica and says where. The package's fleet (conftest.py `ingress_url`, shared with
test_replicas.py); tests run in file order and each measures what it changed."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from gateway.api.dashboard import STATIC_DIR
from gateway.edge.handlers import DASHBOARD_CSP
from gateway.proxy.routing import AffinityRouter, affinity_key
from gateway.serve_ray import engine_name
from tests.observability.test_dashboard_browser import Page, browser  # noqa: F401  # browser: a fixture
from tests.proxy.conftest import group_id, metric
from tests.serve_ray.conftest import REPLICAS
from tests.serve_ray.test_replicas import TOOLS, ask, client_for, replica_metrics, samples
from tests.support.waiting import wait_until

pytest.importorskip("ray.serve")

NAMES = [engine_name(i) for i in range(REPLICAS)]
# A table's rows at one instant: {row's data-<key> (or index): {cell's data-field (or index): text}}.
TABLE_SCRIPT = """
const [selector, key] = arguments, rows = {};
document.querySelectorAll(selector + " tbody tr").forEach((row, i) => {
  const cells = {};
  row.querySelectorAll("td").forEach((c, j) => { cells[c.dataset.field || j] = c.textContent.trim(); });
  rows[key ? row.dataset[key] : i] = cells;
});
return rows;
"""


@pytest.fixture
def fleet_url(ingress_url: str) -> str:
    """The package's fleet, shared with test_replicas.py (conftest.py)."""
    return ingress_url


def get(base_url: str, path: str) -> httpx.Response:
    return httpx.get(base_url + path, timeout=60)


def stats(base_url: str) -> dict[str, Any]:
    resp = get(base_url, "/v1/dashboard/stats")
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def rows(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in body["replicas"]}


def home(system: str | None, tools: list[dict[str, Any]] = TOOLS) -> str:
    """The replica the ingress routes this group to (none being busy or down)."""
    ranked = AffinityRouter([f"http://{n}" for n in NAMES], 1).ranking(affinity_key("", group_id(system, tools)))
    return ranked[0].removeprefix("http://")


def one_system_per_replica(prefix: str) -> dict[str, str]:
    """A system prompt whose group's home is each replica (replica name -> system)."""
    found: dict[str, str] = {}
    for n in range(64):
        found.setdefault(home(f"{prefix} {n}."), f"{prefix} {n}.")
    assert set(found) == set(NAMES)
    return found


def entries(base_url: str) -> list[dict[str, Any]]:
    resp = get(base_url, "/v1/cache")
    assert resp.status_code == 200, resp.text
    data: list[dict[str, Any]] = resp.json()["data"]
    return data


def test_health_names_every_replica_and_its_status(fleet_url):
    resp = get(fleet_url, "/health")
    assert resp.status_code == 200
    body = resp.json()
    assert body["status"] == "ok" and body["mode"] == "replicas"
    assert [(r["name"], r["status"], r["in_flight"]) for r in body["replicas"]] == [(n, "ok", 0) for n in NAMES]


def test_the_dashboard_page_is_served_with_the_browser_guards_headers(fleet_url):
    page = get(fleet_url, "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == DASHBOARD_CSP
    assert page.headers["x-frame-options"] == "DENY"
    assert 'id="replicas"' in page.text
    script = get(fleet_url, "/static/dashboard.js")
    assert script.content == (STATIC_DIR / "dashboard.js").read_bytes()
    assert get(fleet_url, "/static/..%2Fdashboard.py").status_code == 404


def test_dashboard_stats_count_each_replicas_hits_and_misses_and_the_fleets_totals(fleet_url):
    systems = one_system_per_replica("Dashboard shop")
    before = stats(fleet_url)
    client = client_for(fleet_url)
    for turn in range(3):  # a miss on each group's home, then hits there
        for system in systems.values():
            ask(client, system, f"question {turn}")
    after = stats(fleet_url)

    assert after["status"] == "ok" and after["mode"] == "replicas" and after["model"] == "tiny-llama"
    for name in NAMES:
        was, now = rows(before)[name], rows(after)[name]
        assert (now["status"], now["in_flight"]) == ("ok", 0)
        assert now["lookups"]["miss"] - was["lookups"].get("miss", 0) == 1, name  # its own group, compiled once
        assert now["lookups"]["hit"] - was["lookups"].get("hit", 0) == 2, name
        assert now["requests"] - was["requests"] == 3, name
        own = replica_metrics(NAMES.index(name))  # the replica's own /metrics, not through the ingress
        assert now["lookups"]["hit"] == metric(own, "toolkv_cache_lookups_total", result="hit"), name
        assert now["cache_entries"]["ram"] == metric(own, "toolkv_cache_entries", tier="ram") >= 1, name
    totals = after["totals"]
    assert totals["requests"] - before["totals"]["requests"] == 3 * len(NAMES)  # as the ingress answered them
    assert totals["lookups"]["miss"] == sum(row["lookups"]["miss"] for row in after["replicas"])
    assert totals["cache_entries"]["ram"] == sum(row["cache_entries"]["ram"] for row in after["replicas"])
    assert totals["cache_entries"]["disk"] == max(row["cache_entries"]["disk"] for row in after["replicas"])
    engine = after["engine"]
    assert engine["kv_blocks"]["total"] == engine["kv_blocks"]["used"] + engine["kv_blocks"]["free"] > 0
    assert engine["prefix_cache"]["hits_tokens"] > 0

    groups = {(g["group_id"], g["replica"]) for g in after["groups"]}
    for name, system in systems.items():
        assert (group_id(system, TOOLS), name) in groups, name  # each group in RAM on its home only
        assert (group_id(system, TOOLS), next(n for n in NAMES if n != name)) not in groups, name
    seen = {label: sum(w[label]["count"] for w in after["ttft_windows"] if label in w) for label in ("hit", "miss")}
    assert seen["hit"] >= 2 * len(NAMES) and seen["miss"] >= len(NAMES)  # the chart has both replicas' requests


def test_the_page_shows_each_replica_as_the_stats_do(fleet_url, browser):  # noqa: F811
    browser.get(fleet_url + "/")
    page = Page(browser)
    page.wait_for(lambda: page.attr("status", "data-status") == "ok")
    assert page.displayed("replicas") and page.attr("title-engine", "textContent") == "Engines (all replicas)"
    page.set_value("play-max-tokens", "3")
    page.send()  # a miss on the example tools' home replica, and a bypass
    tools = json.loads(page.attr("play-tools", "value"))
    where = home(None, tools)

    def shown() -> dict[str, dict[str, str]]:
        """The replica table's cells by replica and field, read at once (the page redraws it)."""
        table: dict[str, dict[str, str]] = page.driver.execute_script(TABLE_SCRIPT, "#replica-table", "replica")
        return table

    def matches_stats() -> bool:
        on_page, expected = shown(), rows(stats(fleet_url))
        return set(on_page) == set(NAMES) and all(
            on_page[n]["hits"] == str(int(expected[n]["lookups"].get("hit", 0)))
            and on_page[n]["misses"] == str(int(expected[n]["lookups"].get("miss", 0))) for n in NAMES)

    page.wait_for(matches_stats)
    assert all(row["status"] == "up" for row in shown().values())
    assert page.badge("run-cache") == "miss"
    groups = page.driver.execute_script(TABLE_SCRIPT, "#groups", None)
    assert [row["6"] for row in groups.values() if "get_weather" in row["1"]] == [where]  # its row names its replica


def test_deleting_an_entry_takes_it_off_every_replica(fleet_url):
    system = "Deleted shop assistant."
    ask(client_for(fleet_url), system, "compile")
    where = home(system)
    [entry_id] = {e["id"] for e in entries(fleet_url) if e["group_id"] == group_id(system, TOOLS)}

    resp = httpx.delete(f"{fleet_url}/v1/cache/{entry_id}", timeout=60)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["id"] == entry_id and body["object"] == "toolkv.cache_entry.deleted" and body["deleted"] is True
    assert where in body["replicas"] and set(body["replicas"]) <= set(NAMES)
    assert entry_id not in {e["id"] for e in entries(fleet_url)}  # on no replica, in no tier

    misses = metric(samples(get(fleet_url, "/metrics").text), "toolkv_cache_lookups_total", result="miss")
    ask(client_for(fleet_url), system, "compile again")
    fleet = samples(get(fleet_url, "/metrics").text)
    assert metric(fleet, "toolkv_cache_lookups_total", result="miss") == misses + 1  # compiled anew

    again = httpx.delete(f"{fleet_url}/v1/cache/{'0' * 64}", timeout=60)
    assert again.status_code == 404 and again.json()["error"]["param"] == "id"
    bad = httpx.delete(f"{fleet_url}/v1/cache/not-an-id", timeout=60)
    assert bad.status_code == 400 and "64 lowercase hex" in bad.json()["error"]["message"]


def test_one_entry_is_shown_where_it_was_used_with_every_replica_holding_it(fleet_url):
    system = "Looked-up shop assistant."
    ask(client_for(fleet_url), system, "compile")
    [entry_id] = {e["id"] for e in entries(fleet_url) if e["group_id"] == group_id(system, TOOLS)}
    body = get(fleet_url, f"/v1/cache/{entry_id}").json()
    assert body["id"] == entry_id and "ram" in body["tiers"]
    assert body["replica"] == home(system)
    listed = {e["replica"] for e in entries(fleet_url) if e["id"] == entry_id}
    assert set(body["replicas"]) == listed  # the shared disk tier: each replica that can load it


def test_clearing_the_cache_empties_every_replica(fleet_url):
    systems = one_system_per_replica("Cleared shop")
    for system in systems.values():
        ask(client_for(fleet_url), system, "compile")
    resp = httpx.delete(fleet_url + "/v1/cache", timeout=60)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "toolkv.cache.cleared"
    assert [r["replica"] for r in body["replicas"]] == NAMES
    assert all(r["deleted"] >= 1 for r in body["replicas"])  # each held its own group in RAM
    assert body["deleted"] == sum(r["deleted"] for r in body["replicas"])
    assert entries(fleet_url) == []
    assert wait_until(lambda: stats(fleet_url)["groups"] == [])
    assert all(row["cache_entries"]["ram"] == 0 for row in stats(fleet_url)["replicas"])
