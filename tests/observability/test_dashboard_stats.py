"""The dashboard's server side: the page and its assets come from the package (no CDN), and
/v1/dashboard/stats reports what the gateway did; TTFT percentiles per window match Prometheus'."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.api.dashboard import STATIC_DIR, TtftWindows, max_bound, quantile, ttft_ceiling_ms
from gateway.metrics import Metrics
from tests.observability.traffic import Exercised, scrape
from tests.support.server import LiveServer


def _stats(exercised: Exercised) -> dict[str, Any]:
    resp = httpx.get(exercised.server.base_url + "/v1/dashboard/stats", timeout=30)
    resp.raise_for_status()
    body: dict[str, Any] = resp.json()
    return body


def test_page_and_assets_are_served_from_the_package(exercised: Exercised) -> None:
    base = exercised.server.base_url
    page = httpx.get(base + "/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', page.text)
    assert {"/static/dashboard.js", "/static/dashboard.css"} <= set(assets)
    for asset in assets:
        resp = httpx.get(base + asset, timeout=30)
        assert resp.status_code == 200, asset
        assert resp.content == (STATIC_DIR / asset.removeprefix("/static/")).read_bytes()


def test_no_asset_loads_anything_from_another_host() -> None:
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        urls = set(re.findall(r"https?://[^\s\"'<>)]+", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, path.name
        assert not re.search(r"""(?:src|href)=["']//""", text), path.name


@pytest.mark.parametrize("name", ["nope.js", "%2e%2e", "..%2Fdashboard.py", "dashboard.py", "index.txt"])
def test_unknown_asset_is_a_404_envelope(exercised: Exercised, name: str) -> None:
    resp = httpx.get(f"{exercised.server.base_url}/static/{name}", timeout=30)
    assert resp.status_code == 404
    assert set(resp.json()["error"]) >= {"message", "type", "code"}


def test_stats_need_the_admin_key_once_keys_are_configured(start_gateway: Callable[..., LiveServer]) -> None:
    server = start_gateway(api_keys=("user-key",), admin_key="admin-key")
    url = server.base_url + "/v1/dashboard/stats"
    assert httpx.get(server.base_url + "/", timeout=30).status_code == 200  # the page holds no data
    assert httpx.get(url, timeout=30).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer user-key"}, timeout=30).status_code == 403
    assert httpx.get(url, headers={"Authorization": "Bearer admin-key"}, timeout=30).status_code == 200


def test_stats_report_hit_rate_tokens_and_the_cached_tool_group(exercised: Exercised) -> None:
    stats = _stats(exercised)
    totals = stats["totals"]
    assert stats["status"] == "ok"
    assert totals["requests"] == 3 and totals["errors"] == 0
    assert totals["lookups"] == {"hit": 1, "miss": 1, "bypass": 1}
    assert totals["hit_rate"] == 0.5
    assert totals["cached_tokens"] == sum(u.prompt_tokens_details.cached_tokens for u in exercised.usages)
    assert totals["cache_entries"]["ram"] == 1
    [group] = stats["groups"]
    assert sorted(group["tool_names"]) == ["get_time", "get_weather"]
    assert group["hits"] == 1 and group["tier"] == "ram"
    assert group["num_tokens"] == totals["cached_tokens"] and group["num_bytes"] == totals["cache_bytes"]["ram"]


def test_stats_report_the_engine_as_its_metrics_do(exercised: Exercised) -> None:
    engine = _stats(exercised)["engine"]
    _, families = scrape(exercised.server)  # the gateway is idle: nothing changes in between

    def metric(name: str, **labels: str) -> float:
        return sum(s.value for f in families.values() for s in f.samples
                   if s.name == name and labels.items() <= s.labels.items())

    assert engine["running"] == metric("vllm:num_requests_running")
    assert engine["waiting"] == metric("vllm:num_requests_waiting")
    assert engine["steps"] == metric("toolkv_engine_steps_total")
    assert engine["preemptions"] == metric("vllm:num_preemptions_total")
    assert engine["kv_usage"] == metric("vllm:kv_cache_usage_perc")
    kv = engine["kv_blocks"]
    for state in ("used", "free", "cached"):
        assert kv[state] == metric("toolkv_kv_blocks", state=state), state
    assert kv["total"] == kv["used"] + kv["free"]
    prefix = engine["prefix_cache"]
    assert prefix["queries_tokens"] == metric("vllm:prefix_cache_queries_total")
    assert prefix["hits_tokens"] == metric("vllm:prefix_cache_hits_total")
    queries = prefix["queries_tokens"]
    assert prefix["hit_rate"] == (prefix["hits_tokens"] / queries if queries else None)
    steps = metric("vllm:iteration_tokens_total_count")
    for key, histogram in (("tokens_per_step", "vllm:iteration_tokens_total"), ("batch_size", "toolkv_batch_size")):
        mean = metric(histogram + "_sum") / steps if steps else None
        assert engine[key]["mean"] == (pytest.approx(mean) if mean is not None else None), key
        assert (engine[key]["last"] is None) == (steps == 0), key


def test_stats_have_no_engine_before_the_model_has_loaded() -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from gateway.api import dashboard
    from gateway.api.app import new_state
    from gateway.settings import load_settings

    app = FastAPI()
    app.include_router(dashboard.router)
    app.state.gateway = new_state(load_settings(environ={}))  # no model: still loading
    body = TestClient(app).get("/v1/dashboard/stats").json()
    assert body["status"] == "loading" and body["engine"] is None and body["groups"] == []


def test_stats_chart_a_ttft_point_for_hits_and_misses(exercised: Exercised) -> None:
    windows = _stats(exercised)["ttft_windows"]
    seen = {label: sum(w[label]["count"] for w in windows if label in w) for label in ("hit", "miss", "bypass")}
    assert seen == {"hit": 1, "miss": 1, "bypass": 1}
    for window in windows:
        for label in ("hit", "miss"):
            if label in window:
                assert 0 < window[label]["p50_ms"] <= window[label]["p95_ms"]


def test_stats_give_the_chart_a_ceiling_at_the_highest_point(exercised: Exercised) -> None:
    stats = _stats(exercised)
    values = [w[label][key] for w in stats["ttft_windows"] for label in ("hit", "miss") if label in w
              for key in ("p50_ms", "p95_ms")]
    assert stats["ttft_ceiling_ms"] == pytest.approx(max(values))  # one point per series: no outlier


def _window(t: float, **series: tuple[float, float]) -> dict[str, Any]:
    return {"t": t, **{label: {"count": 3, "mean_ms": p50, "p50_ms": p50, "p95_ms": p95}
                       for label, (p50, p95) in series.items()}}


def test_chart_ceiling_leaves_out_one_outlier() -> None:
    """The first request after start took 159 s, later misses 14.5 s, hits ~0.1 s: the axis stops at
    the highest other point, so the hits and misses stay readable; the page marks the outlier."""
    windows = [_window(0, miss=(159_000.0, 159_000.0)),
               *(_window(10 * k, hit=(110.0 + k, 130.0 + k), miss=(14_500.0 + k, 15_000.0 + k)) for k in range(1, 6))]
    assert ttft_ceiling_ms(windows) == 15_005.0
    assert ttft_ceiling_ms(windows[:2]) == 15_001.0  # two points in a series: each against the other
    assert ttft_ceiling_ms(windows[1:]) == 15_005.0  # no outlier: the highest point


def test_chart_ceiling_keeps_points_of_the_same_order_and_each_series_apart() -> None:
    misses = [_window(10 * k, miss=(3_000.0 * (k + 1), 3_500.0 * (k + 1))) for k in range(4)]  # 3 to 14 s
    assert ttft_ceiling_ms(misses) == 14_000.0
    hits_and_misses = [_window(0, hit=(100.0, 120.0)), _window(10, hit=(400.0, 450.0), miss=(9_000.0, 9_500.0))]
    assert ttft_ceiling_ms(hits_and_misses) == 9_500.0  # hits far below misses are no outliers of theirs
    assert ttft_ceiling_ms([]) is None and ttft_ceiling_ms([{"t": 0}]) is None
    spike = [_window(10 * k, hit=(100.0, 100.0)) for k in range(5)] + [_window(60, hit=(100.0, 2_000.0))]
    assert ttft_ceiling_ms(spike) == 100.0  # one window's p95 twenty times the others'


def test_quantile_matches_prometheus_histogram_quantile() -> None:
    bounds = [0.1, 0.5, 1.0]
    cumulative = [2.0, 6.0, 10.0, 10.0]  # 2 in (0, .1], 4 in (.1, .5], 4 in (.5, 1], none above
    assert quantile(0.5, bounds, cumulative) == pytest.approx(0.1 + 0.4 * (3 / 4))
    assert quantile(0.95, bounds, cumulative) == pytest.approx(0.5 + 0.5 * (3.5 / 4))
    assert quantile(0.99, bounds, [0.0, 0.0, 0.0, 5.0]) == 1.0  # all in +Inf: the highest bound


def test_windows_hold_only_what_changed_since_the_previous_look() -> None:
    metrics = Metrics()
    windows = TtftWindows(window_s=10.0, max_windows=2)
    metrics.ttft.labels(cache="hit").observe(0.03)
    windows.sample(metrics.ttft, now_s=105.0)
    windows.sample(metrics.ttft, now_s=108.0)  # nothing new: no new point
    for value in (0.002, 0.003, 0.07):
        metrics.ttft.labels(cache="miss").observe(value)
    windows.sample(metrics.ttft, now_s=112.0)
    first, second = windows.to_json()
    assert first["t"] == 100.0 and first["hit"]["count"] == 1
    assert first["hit"]["p50_ms"] == pytest.approx(30.0)  # one request is its own p50
    assert second["t"] == 110.0 and "hit" not in second and second["miss"]["count"] == 3
    assert second["miss"]["p50_ms"] == pytest.approx(4.0)  # rank 1.5 of 2 in (1 ms, 5 ms]
    # rank 2.85 is 77 ms, 0.85 of the way in (60, 80], past the slowest (70 ms): clamped to what the
    # histogram allows it, 75 ms in all less the others' least (1 ms each)
    assert second["miss"]["p95_ms"] == pytest.approx(73.0)
    metrics.ttft.labels(cache="hit").observe(0.01)
    windows.sample(metrics.ttft, now_s=125.0)
    assert [w["t"] for w in windows.to_json()] == [110.0, 120.0]  # bounded: the oldest is dropped


def test_a_windows_quantiles_never_pass_its_slowest_request() -> None:
    """The first request after start took 338 s and a miss beside it 16 s, in one window: p95
    interpolated inside the 160-640 s bucket said 592 s (544 s in the report that found it)."""
    metrics = Metrics()
    windows = TtftWindows(window_s=10.0)
    for seconds in (338.0, 16.0):
        metrics.ttft.labels(cache="miss").observe(seconds)
    windows.sample(metrics.ttft, now_s=5.0)  # the histogram alone (a server without the max gauge)
    [window] = windows.to_json()
    assert 338_000.0 <= window["miss"]["p95_ms"] <= 344_000.0  # at most 354 s less the other's least, 10 s
    assert window["miss"]["p50_ms"] <= window["miss"]["p95_ms"]
    tracked, windows = Metrics(), TtftWindows(window_s=10.0)
    for seconds in (338.0, 16.0):
        tracked.observe_ttft("miss", seconds)  # as the serving layer records a request
    windows.sample(tracked.registry, now_s=5.0)
    tracked.observe_ttft("miss", 20.0)
    tracked.observe_ttft("miss", 18.0)
    windows.sample(tracked.registry, now_s=15.0)
    slow, later = windows.to_json()
    assert slow["miss"]["p95_ms"] == pytest.approx(338_000.0)  # the slowest, tracked: exact
    assert later["miss"]["p95_ms"] <= 20_000.0  # both in (10, 20]: the bucket's bound


def test_max_bound_is_the_top_bucket_or_the_sum_less_the_others_least() -> None:
    bounds = [1.0, 10.0, 100.0]
    assert max_bound(bounds, [0.0, 1.0, 2.0, 2.0], 60.0) == pytest.approx(59.0)  # 1 in (1, 10], 1 in (10, 100]
    assert max_bound(bounds, [0.0, 0.0, 2.0, 2.0], 150.0) == pytest.approx(100.0)  # the bucket's bound is less
    assert max_bound(bounds, [0.0, 0.0, 0.0, 1.0], 900.0) == pytest.approx(900.0)  # +Inf: one request, the sum
