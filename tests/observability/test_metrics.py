"""What a Prometheus server scrapes from a real gateway after real requests: every family with its
type and labels, counters named `*_total`, vLLM's TTFT buckets, bounded label values, counts that
agree with what the clients were told, and an exposition promtool accepts."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gateway.kvcache.disk_tier import DiskTier
from tests.observability.traffic import Exercised, scrape
from tests.support.server import LiveServer

# vLLM's time_to_first_token_seconds buckets, written out here so a change in gateway/metrics.py fails.
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]

# Family name as the exposition parser reports it (counters without `_total`) -> (type, labels).
EXPECTED_FAMILIES: dict[str, tuple[str, set[str]]] = {
    "toolkv_requests": ("counter", {"status", "stream"}),
    "toolkv_cache_lookups": ("counter", {"result", "tier"}),
    "toolkv_prompt_tokens": ("counter", set()),
    "toolkv_prompt_tokens_cached": ("counter", set()),
    "toolkv_prompt_tokens_computed": ("counter", set()),
    "toolkv_generation_tokens": ("counter", set()),
    "toolkv_time_to_first_token_seconds": ("histogram", {"cache"}),
    "toolkv_time_to_first_token_max_seconds": ("gauge", {"cache"}),
    "toolkv_e2e_request_latency_seconds": ("histogram", {"cache"}),
    "toolkv_prefix_compile_seconds": ("histogram", set()),
    "toolkv_prefix_restore_seconds": ("histogram", set()),
    "toolkv_cache_entries": ("gauge", {"tier"}),
    "toolkv_cache_bytes": ("gauge", {"tier"}),
    "toolkv_cache_evictions": ("counter", {"tier"}),
    "toolkv_cache_errors": ("counter", {"kind"}),
    "toolkv_queue_depth": ("gauge", set()),
    "toolkv_requests_in_flight": ("gauge", set()),
    "toolkv_model_loaded": ("gauge", set()),
    "toolkv_tool_call_parse_failures": ("counter", set()),
    "toolkv_batch_size": ("histogram", set()),
    "toolkv_kv_blocks": ("gauge", {"state"}),
    "toolkv_engine_steps": ("counter", set()),
    # the engine under vLLM's names, with vLLM's labels
    "vllm:num_requests_running": ("gauge", {"model_name", "engine"}),
    "vllm:num_requests_waiting": ("gauge", {"model_name", "engine"}),
    "vllm:kv_cache_usage_perc": ("gauge", {"model_name", "engine"}),
    "vllm:num_preemptions": ("counter", {"model_name", "engine"}),
    "vllm:prefix_cache_queries": ("counter", {"model_name", "engine"}),
    "vllm:prefix_cache_hits": ("counter", {"model_name", "engine"}),
    "vllm:iteration_tokens_total": ("histogram", {"model_name", "engine"}),
}
# Histograms of counts (sequences per step) have no unit to carry.
UNITLESS_HISTOGRAMS = {"toolkv_batch_size"}
# vLLM's names break two of promtool's lint rules; toolkv keeps them so vLLM's dashboards work.
VLLM_LINT_PROBLEMS = {"metric names should not contain ':'",
                      'non-counter metrics should not have "_total" suffix'}

BOUNDED_LABEL_VALUES = {
    "cache": {"hit", "miss", "bypass", "skip"},
    "result": {"hit", "miss", "bypass", "skip"},
    "tier": {"ram", "disk", "none"},
    "stream": {"true", "false"},
    "state": {"used", "free", "cached"},
    "engine": {"0"},
}


def _value(exercised: Exercised, family: str, **labels: str) -> float:
    _, families = scrape(exercised.server)
    return sum(s.value for s in families[family].samples
               if s.name == _sample_name(family, families[family].type) and labels.items() <= s.labels.items())


def _sample_name(family: str, kind: str) -> str:
    return {"counter": family + "_total", "histogram": family + "_count"}.get(kind, family)


@pytest.mark.parametrize("name", sorted(EXPECTED_FAMILIES))
def test_metric_family_is_exported_with_its_type_and_labels(exercised: Exercised, name: str) -> None:
    kind, label_names = EXPECTED_FAMILIES[name]
    _, families = scrape(exercised.server)
    assert name in families, f"{name} is missing from /metrics"
    assert families[name].type == kind
    for sample in families[name].samples:  # families never observed have no samples to check
        assert set(sample.labels) - {"le"} == label_names, sample


def test_counters_are_named_total_and_histograms_carry_their_unit(exercised: Exercised) -> None:
    text, _ = scrape(exercised.server)
    declared = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE))
    toolkv = {name: kind for name, kind in declared.items() if name.startswith("toolkv_")}
    assert toolkv, "no toolkv_ metric declared"
    for name, kind in toolkv.items():
        if kind == "counter":
            assert name.endswith("_total"), name
        if kind == "histogram" and name not in UNITLESS_HISTOGRAMS:
            assert name.endswith("_seconds"), name


def test_ttft_histogram_has_vllm_buckets_for_every_cache_result(exercised: Exercised) -> None:
    _, families = scrape(exercised.server)
    buckets: dict[str, list[str]] = {}
    for sample in families["toolkv_time_to_first_token_seconds"].samples:
        if sample.name.endswith("_bucket"):
            buckets.setdefault(sample.labels["cache"], []).append(sample.labels["le"])
    assert set(buckets) == {"hit", "miss", "bypass"}
    expected = [str(b) for b in VLLM_TTFT_BUCKETS] + ["+Inf"]
    for cache, les in buckets.items():
        assert les == expected, cache


def test_label_values_are_bounded_and_never_carry_prompts(exercised: Exercised) -> None:
    _, families = scrape(exercised.server)
    for family in families.values():
        for sample in family.samples:
            for label, value in sample.labels.items():
                assert value in BOUNDED_LABEL_VALUES.get(label, {value}), (sample.name, label, value)
                assert "Paris" not in value and "weather" not in value, sample
            if "status" in sample.labels:
                assert sample.labels["status"].isdigit(), sample


def test_token_counters_agree_with_the_usage_clients_received(exercised: Exercised) -> None:
    usages = exercised.usages
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert _value(exercised, "toolkv_prompt_tokens") == sum(u.prompt_tokens for u in usages)
    assert _value(exercised, "toolkv_prompt_tokens_cached") == cached > 0
    assert _value(exercised, "toolkv_prompt_tokens_computed") == sum(u.prompt_tokens for u in usages) - cached
    assert _value(exercised, "toolkv_generation_tokens") == sum(u.completion_tokens for u in usages)


def test_request_and_lookup_counters_count_each_request_once(exercised: Exercised) -> None:
    assert _value(exercised, "toolkv_requests", status="200", stream="true") == exercised.streams
    assert _value(exercised, "toolkv_requests", status="200", stream="false") == exercised.non_streams
    for result in ("hit", "miss", "bypass"):
        assert _value(exercised, "toolkv_cache_lookups", result=result) == 1, result
        assert _value(exercised, "toolkv_time_to_first_token_seconds", cache=result) == 1, result
    assert _value(exercised, "toolkv_cache_lookups", result="hit", tier="ram") == 1


def test_cache_gauges_show_the_stored_prefix_and_the_model_as_ready(exercised: Exercised) -> None:
    assert _value(exercised, "toolkv_cache_entries", tier="ram") == 1
    assert _value(exercised, "toolkv_cache_bytes", tier="ram") > 0
    assert _value(exercised, "toolkv_model_loaded") == 1
    assert _value(exercised, "toolkv_prefix_compile_seconds") == 1
    assert _value(exercised, "toolkv_prefix_restore_seconds") == 1


def test_no_created_series(exercised: Exercised) -> None:
    """Counters and histograms carry no `_created` timestamp series, in the model app's exposition
    and in proxy mode's (one process-wide switch, set when gateway.metrics is imported)."""
    from prometheus_client import generate_latest

    from gateway.proxy.metrics import ProxyMetrics, Usage

    text, _ = scrape(exercised.server)
    assert "toolkv_requests_total{" in text and "toolkv_time_to_first_token_seconds_count{" in text
    assert [line for line in text.splitlines() if "_created" in line] == []
    proxy = ProxyMetrics()
    proxy.requests.labels(status="200", stream="true").inc()
    proxy.observe_usage("http://upstream", Usage(prompt_tokens=10, cached_tokens=8))
    proxy.ttft.labels(cache="hit", upstream="http://upstream").observe(0.1)
    proxy_text = generate_latest(proxy.registry).decode()
    assert "toolkv_requests_total{" in proxy_text and "toolkv_time_to_first_token_seconds_count{" in proxy_text
    assert [line for line in proxy_text.splitlines() if "_created" in line] == []


def test_promtool_accepts_the_exposition(exercised: Exercised) -> None:
    """`promtool check metrics` parses the scrape; its only complaints are the two rules vLLM's
    names break, and only about vllm: series."""
    if shutil.which("promtool") is None:
        pytest.fail("promtool is missing: install it with `bash .ci/install-promtool.sh`")
    text, _ = scrape(exercised.server)
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                            timeout=120, check=False)
    problems = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode in (0, 3), problems  # 3: lint problems only, the text parsed
    for line in problems:
        name, _, problem = line.partition(" ")
        assert name.startswith("vllm:") and problem in VLLM_LINT_PROBLEMS, line


def test_a_scrape_listing_a_large_cache_dir_never_holds_up_other_requests(
        start_gateway: Callable[..., LiveServer], monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting the disk tier lists the cache dir (0.45 s for 20,000 files); /metrics needs no key,
    and that listing ran on the event loop: every stream and /health waited behind each scrape."""
    server = start_gateway()
    listing, release = threading.Event(), threading.Event()
    usage = DiskTier.usage

    def slow_usage(self: DiskTier) -> tuple[int, int]:
        listing.set()
        release.wait(60)
        return usage(self)

    monkeypatch.setattr(DiskTier, "usage", slow_usage)
    with ThreadPoolExecutor(2) as pool:
        scrape = pool.submit(httpx.get, server.base_url + "/metrics", timeout=120)
        assert listing.wait(60)
        second = httpx.get(server.base_url + "/metrics", timeout=10)  # another scrape: served the values there are
        health = httpx.get(server.base_url + "/health", timeout=10)
        release.set()
        assert (health.status_code, second.status_code, scrape.result().status_code) == (200, 200, 200)
    assert "toolkv_cache_bytes" in second.text
