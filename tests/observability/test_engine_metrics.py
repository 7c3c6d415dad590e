"""The engine's series under vLLM's names (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`,
`vllm:prefix_cache_hits_total`, `vllm:iteration_tokens_total`, ...) and toolkv's own (batch size,
KV blocks, steps): first how `Metrics.observe_engine` turns the engine's snapshots into Prometheus
series, then what a real gateway exports after real requests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.metrics_core import Metric

from gateway.engine.stats import EngineStats, StepRecord
from gateway.metrics import Metrics
from tests.observability.traffic import Exercised, chat, openai_client, scrape
from tests.support.server import LiveServer
from tests.support.waiting import wait_until

# vLLM's vllm:iteration_tokens_total buckets, written out so a change in gateway/metrics.py fails.
VLLM_ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
VLLM_LABELS = {"model_name", "engine"}
IDLE_DEADLINE_S = 30.0


def _stats(**fields: int) -> EngineStats:
    base = dict(running=0, waiting=0, kv_blocks_total=0, kv_blocks_used=0, kv_blocks_cached=0, kv_block_tokens=0,
                preemptions_total=0, prefix_queries_tokens_total=0, prefix_hits_tokens_total=0, steps_total=0,
                cancelled_total=0)
    return EngineStats(**(base | fields))


def _get(families: dict[str, Metric], sample_name: str, **labels: str) -> float:
    """The sum of the samples called `sample_name` (with these labels) across the families."""
    return sum(s.value for family in families.values() for s in family.samples
               if s.name == sample_name and labels.items() <= s.labels.items())


def _registry(metrics: Metrics) -> dict[str, Metric]:
    return {family.name: family for family in metrics.registry.collect()}


def _idle(server: LiveServer) -> dict[str, Metric]:
    """A scrape once the engine says nothing is running or waiting: the last response can reach the
    client a moment before the engine marks its sequence done, so this polls, with a deadline."""
    families: dict[str, Metric] = {}

    def idle() -> bool:
        nonlocal families
        _, families = scrape(server)
        return _get(families, "vllm:num_requests_running") + _get(families, "vllm:num_requests_waiting") == 0

    wait_until(idle, IDLE_DEADLINE_S, interval_s=0.05)
    return families


# ---- observe_engine ------------------------------------------------------------------------------


def test_snapshot_gauges_become_vllm_gauges_and_kv_block_states() -> None:
    metrics = Metrics()
    metrics.observe_engine(_stats(running=3, waiting=2, kv_blocks_total=100, kv_blocks_used=40,
                                  kv_blocks_cached=15, kv_block_tokens=16), [], model_name="m")
    families = _registry(metrics)
    labels = {"model_name": "m", "engine": "0"}
    assert _get(families, "vllm:num_requests_running", **labels) == 3
    assert _get(families, "vllm:num_requests_waiting", **labels) == 2
    assert _get(families, "vllm:kv_cache_usage_perc", **labels) == pytest.approx(0.4)
    assert _get(families, "toolkv_queue_depth") == 2  # the waiting sequences, as before
    assert {state: _get(families, "toolkv_kv_blocks", state=state) for state in ("used", "free", "cached")} == {
        "used": 40, "free": 60, "cached": 15}
    assert metrics.engine.kv_blocks_total == 100 and metrics.engine.kv_block_tokens == 16


def test_counters_advance_by_what_the_totals_grew_since_the_last_look() -> None:
    metrics = Metrics()
    looks = [dict(preemptions_total=1, prefix_queries_tokens_total=100, prefix_hits_tokens_total=64, steps_total=5),
             dict(preemptions_total=1, prefix_queries_tokens_total=100, prefix_hits_tokens_total=64, steps_total=5),
             dict(preemptions_total=4, prefix_queries_tokens_total=250, prefix_hits_tokens_total=192, steps_total=9)]
    for look in looks:  # a look that saw no change adds nothing
        metrics.observe_engine(_stats(**look), [], model_name="m")
    families = _registry(metrics)
    assert _get(families, "vllm:num_preemptions_total") == 4
    assert _get(families, "vllm:prefix_cache_queries_total") == 250
    assert _get(families, "vllm:prefix_cache_hits_total") == 192
    assert _get(families, "toolkv_engine_steps_total") == 9


def test_totals_that_restart_from_zero_count_as_new() -> None:
    metrics = Metrics()
    metrics.observe_engine(_stats(steps_total=10, prefix_hits_tokens_total=64), [], model_name="m")
    metrics.observe_engine(_stats(steps_total=3, prefix_hits_tokens_total=32), [], model_name="m")  # a new engine
    families = _registry(metrics)
    assert _get(families, "toolkv_engine_steps_total") == 13  # a counter never goes down
    assert _get(families, "vllm:prefix_cache_hits_total") == 96


def test_each_step_is_one_observation_of_tokens_and_of_batch_size() -> None:
    metrics = Metrics()
    steps = [StepRecord(batch_size=1, num_tokens=700, seconds=0.3), StepRecord(batch_size=3, num_tokens=3, seconds=0.1),
             StepRecord(batch_size=2, num_tokens=9, seconds=0.1)]
    metrics.observe_engine(_stats(steps_total=3), steps, model_name="m")
    metrics.observe_engine(_stats(steps_total=3), [], model_name="m")  # nothing new: the last step stays
    families = _registry(metrics)
    assert _get(families, "vllm:iteration_tokens_total_count", model_name="m", engine="0") == 3
    assert _get(families, "vllm:iteration_tokens_total_sum") == 712
    assert _get(families, "vllm:iteration_tokens_total_bucket", le="8.0") == 1
    assert _get(families, "vllm:iteration_tokens_total_bucket", le="1024.0") == 3
    assert _get(families, "toolkv_batch_size_count") == 3 and _get(families, "toolkv_batch_size_sum") == 6
    assert metrics.engine.last_step == steps[-1]


# ---- a real gateway ------------------------------------------------------------------------------


def test_vllm_series_carry_vllm_labels_and_iteration_token_buckets(exercised: Exercised) -> None:
    _, families = scrape(exercised.server)
    model = openai_client(exercised.server).models.list().data[0].id
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                 "vllm:iteration_tokens_total"):
        assert families[name].samples, f"{name} has no sample"
        for sample in families[name].samples:
            assert {k: v for k, v in sample.labels.items() if k != "le"} == {"model_name": model, "engine": "0"}
    les = [s.labels["le"] for s in families["vllm:iteration_tokens_total"].samples if s.name.endswith("_bucket")]
    assert les == [str(float(b)) for b in VLLM_ITERATION_TOKENS_BUCKETS] + ["+Inf"]


def test_nothing_runs_or_waits_when_the_gateway_is_idle(exercised: Exercised) -> None:
    families = _idle(exercised.server)
    assert _get(families, "vllm:num_requests_running") == 0
    assert _get(families, "vllm:num_requests_waiting") == 0
    assert _get(families, "toolkv_queue_depth") == 0


def test_kv_block_gauges_agree_with_each_other(exercised: Exercised) -> None:
    families = _idle(exercised.server)
    used, free, cached = (_get(families, "toolkv_kv_blocks", state=s) for s in ("used", "free", "cached"))
    usage = _get(families, "vllm:kv_cache_usage_perc")
    assert used >= cached >= 0 and free >= 0
    assert 0 <= usage <= 1
    assert usage == pytest.approx(used / (used + free) if used + free else 0.0)


def test_prefix_cache_hits_never_exceed_queries(exercised: Exercised) -> None:
    _, families = scrape(exercised.server)
    queries = _get(families, "vllm:prefix_cache_queries_total")
    hits = _get(families, "vllm:prefix_cache_hits_total")
    assert queries >= hits >= 0
    assert _get(families, "vllm:num_preemptions_total") >= 0


def test_every_step_of_the_served_requests_is_in_the_histograms(exercised: Exercised) -> None:
    """Needs an engine that reports its steps (the continuous-batching step loop)."""
    families = _idle(exercised.server)
    steps = _get(families, "vllm:iteration_tokens_total_count")
    assert steps > 0, "no engine step was observed after three requests"
    assert _get(families, "toolkv_batch_size_count") == steps
    assert _get(families, "toolkv_engine_steps_total") == steps
    assert _get(families, "vllm:iteration_tokens_total_sum") >= steps  # a step computes at least one token
    assert _get(families, "toolkv_batch_size_sum") >= steps  # and advances at least one sequence
    generated = sum(u.completion_tokens for u in exercised.usages)
    assert _get(families, "vllm:iteration_tokens_total_sum") >= generated


def test_prefix_cache_hits_grow_when_a_tool_group_comes_back(start_gateway: Callable[..., LiveServer]) -> None:
    """Needs an engine that counts prefix cache queries and hits in tokens (the paged KV pool)."""
    server = start_gateway()
    client = openai_client(server)
    chat(client, "What's the weather in Paris?")  # the tool group's first request computes it
    before = _counters(server)
    again = chat(client, "And what time is it in Rome?")
    after = _counters(server)
    hits, queries = after["hits"] - before["hits"], after["queries"] - before["queries"]
    assert 0 < hits <= queries, (before, after)
    assert hits <= again.usage.prompt_tokens
    assert queries >= hits


def _counters(server: LiveServer) -> dict[str, Any]:
    families = _idle(server)
    return {"hits": _get(families, "vllm:prefix_cache_hits_total"),
            "queries": _get(families, "vllm:prefix_cache_queries_total")}
