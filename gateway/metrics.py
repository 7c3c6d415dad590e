"""Prometheus metrics, one registry per app (no module-level state). Names follow Prometheus
conventions: counters end in `_total`, units in names, bounded label values only.

The engine's own series carry vLLM's names, types, buckets and labels (`model_name`, `engine`), so
dashboards and alerts written for vLLM read toolkv unchanged. Those names break two of promtool's
lint rules, as vLLM's do: a `:` in the name, and `vllm:iteration_tokens_total` is a histogram."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics

if TYPE_CHECKING:  # the engine package imports torch; metrics need only its report's shape
    from gateway.engine.stats import EngineStats, StepRecord

# The same buckets as vLLM's time_to_first_token_seconds, so dashboards line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# vLLM's vllm:iteration_tokens_total buckets (vllm/v1/metrics/loggers.py).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
VLLM_LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"  # one engine per gateway process

# No `<name>_created` series (a start timestamp per counter, histogram and label set: lines no
# dashboard here reads). prometheus_client reads this process-wide switch each time it writes
# samples, so every registry in the process (the proxy's too) goes without.
disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes etc. (Linux; nothing elsewhere)
        self.requests = Counter("toolkv_requests_total", "Chat completion requests by HTTP status",
                                ["status", "stream"], registry=r)
        self.cache_lookups = Counter("toolkv_cache_lookups_total",
                                     "Prefix cache lookups by result (hit, miss, bypass, skip) and tier",
                                     ["result", "tier"], registry=r)
        self.prompt_tokens = Counter("toolkv_prompt_tokens_total", "Prompt tokens received", registry=r)
        self.cached_tokens = Counter("toolkv_prompt_tokens_cached_total",
                                     "Prompt tokens served from the prefix cache", registry=r)
        self.computed_tokens = Counter("toolkv_prompt_tokens_computed_total",
                                       "Prompt tokens computed by the model", registry=r)
        self.generated_tokens = Counter("toolkv_generation_tokens_total", "Tokens generated", registry=r)
        self.ttft = Histogram("toolkv_time_to_first_token_seconds",
                              "Time from request arrival to the first generated token",
                              ["cache"], buckets=TTFT_BUCKETS, registry=r)
        self.ttft_max = Gauge("toolkv_time_to_first_token_max_seconds",
                              "The slowest time to first token since start, by cache result", ["cache"], registry=r)
        self._ttft_max_s: dict[str, float] = {}
        self._ttft_lock = threading.Lock()
        self.latency = Histogram("toolkv_e2e_request_latency_seconds", "End-to-end request latency",
                                 ["cache"], buckets=LATENCY_BUCKETS, registry=r)
        self.compile_seconds = Histogram("toolkv_prefix_compile_seconds",
                                         "Time to compute a tool-group prefix KV on a miss",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.restore_seconds = Histogram("toolkv_prefix_restore_seconds",
                                         "Time to restore a cached prefix KV on a hit",
                                         buckets=FAST_BUCKETS, registry=r)
        self.cache_entries = Gauge("toolkv_cache_entries", "Entries per cache tier", ["tier"], registry=r)
        self.cache_bytes = Gauge("toolkv_cache_bytes", "Bytes per cache tier", ["tier"], registry=r)
        self.cache_pinned_bytes = Gauge("toolkv_cache_pinned_bytes", "Bytes of pinned cache entries", registry=r)
        self.evictions = Counter("toolkv_cache_evictions_total", "Entries evicted per tier",
                                 ["tier"], registry=r)
        self.cache_errors = Counter("toolkv_cache_errors_total",
                                    "Cache faults (corrupt file, disk full...) handled as a miss",
                                    ["kind"], registry=r)
        self.responses_store_bytes = Gauge("toolkv_responses_store_bytes",
                                           "Bytes (as JSON) of the kept Responses and the conversation turns they "
                                           "keep alive, all API keys", registry=r)
        self.grammar_cache_bytes = Gauge("toolkv_grammar_cache_bytes",
                                         "Estimated bytes of the compiled grammars kept, all API keys", registry=r)
        self.tokenizer_heads_bytes = Gauge("toolkv_tokenizer_heads_bytes",
                                           "Bytes of the remembered tokenized tool-group heads, all API keys",
                                           registry=r)
        self.memory_budget_bytes = Gauge("toolkv_memory_budget_bytes",
                                         "The byte bound of each bounded in-memory structure (its setting)",
                                         ["structure"], registry=r)
        self.queue_depth = Gauge("toolkv_queue_depth", "Requests waiting for the engine", registry=r)
        self.in_flight = Gauge("toolkv_requests_in_flight", "Requests being served", registry=r)
        self.model_loaded = Gauge("toolkv_model_loaded",
                                  "Model load state: 0 loading, 1 ready, -1 failed", registry=r)
        self.tool_parse_failures = Counter("toolkv_tool_call_parse_failures_total",
                                           "Model outputs that looked like tool calls but did not parse",
                                           registry=r)
        # ---- the engine, under vLLM's names (see the module docstring) ----------------------
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                             VLLM_LABELS, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                             VLLM_LABELS, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                              VLLM_LABELS, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                   VLLM_LABELS, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.",
                                      VLLM_LABELS, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.",
                                   VLLM_LABELS, registry=r)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", VLLM_LABELS,
                                          buckets=ITERATION_TOKENS_BUCKETS, registry=r)
        # ---- the engine, toolkv's own ---------------------------------------------------------
        self.batch_size = Histogram("toolkv_batch_size", "Sequences advanced per engine step",
                                    buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.kv_blocks = Gauge("toolkv_kv_blocks",
                               "KV blocks by state: used (held by sequences or cached prefixes), free, "
                               "and cached (of the used, held only by cached prefixes: reclaimable)",
                               ["state"], registry=r)
        self.engine_steps = Counter("toolkv_engine_steps_total", "Engine steps since start", registry=r)
        self.conversation_records = Gauge("toolkv_conversation_records",
                                          "Earlier prompts whose KV is kept for their conversation's next turn",
                                          registry=r)
        self.conversation_hits = Counter("toolkv_conversation_hit_tokens_total",
                                         "Prompt tokens served from an earlier turn's KV (after the tool group)",
                                         registry=r)
        self.conversation_evictions = Counter("toolkv_conversation_evictions_total",
                                              "Conversation records dropped to make room in the KV pool",
                                              registry=r)
        self.constrained_tokens = Counter("toolkv_constrained_tokens_total",
                                          "Tokens chosen under a grammar (tool calls, structured output)",
                                          registry=r)
        self.constraint_seconds = Counter("toolkv_constraint_seconds_total",
                                          "Time the grammar took for those tokens (masks and following them)",
                                          registry=r)
        self.forced_tokens = Counter("toolkv_forced_tokens_total",
                                     "Of those, tokens the grammar forced: fed to the model as one chunk, not "
                                     "a decode step each", registry=r)
        self.decode_steps = Counter("toolkv_decode_steps_total", "Batched decode forwards", registry=r)
        self.decode_seconds = Counter("toolkv_decode_seconds_total",
                                      "Time of the batched decode forwards (the model, one token per sequence)",
                                      registry=r)
        self.memory = Gauge("toolkv_memory_bytes",
                            "Bytes the engine holds on its device: the model's weights, the KV pool (allocated "
                            "at start-up), the CUDA graphs' memory pool (0 without graphs)", ["part"], registry=r)
        self.engine = EngineView()
        self._engine_totals = TotalsTracker()
        self._engine_lock = threading.Lock()

    def observe_ttft(self, cache: str, seconds: float) -> None:
        """One request's time to first token: the histogram, and the slowest since start (the
        dashboard keeps a window's quantiles at or below the slowest request it can hold)."""
        self.ttft.labels(cache=cache).observe(seconds)
        with self._ttft_lock:
            if seconds > self._ttft_max_s.get(cache, 0.0):
                self._ttft_max_s[cache] = seconds
                self.ttft_max.labels(cache=cache).set(seconds)

    def observe_engine(self, stats: EngineStats, steps: Iterable[StepRecord], model_name: str) -> None:
        """Record one look at the engine: gauges from the snapshot, counters advanced by what the
        snapshot's totals grew since the previous look, one histogram observation per step."""
        steps = list(steps)
        labels = {"model_name": model_name, "engine": ENGINE_INDEX}
        with self._engine_lock:
            self.running.labels(**labels).set(stats.running)
            self.waiting.labels(**labels).set(stats.waiting)
            self.kv_usage.labels(**labels).set(stats.kv_usage)
            self.queue_depth.set(stats.waiting)
            self.kv_blocks.labels(state="used").set(stats.kv_blocks_used)
            self.kv_blocks.labels(state="free").set(max(0, stats.kv_blocks_total - stats.kv_blocks_used))
            self.kv_blocks.labels(state="cached").set(stats.kv_blocks_cached)
            self.conversation_records.set(stats.conversation_records)
            for part, num_bytes in (stats.memory.parts() if stats.memory is not None else {}).items():
                self.memory.labels(part=part).set(num_bytes)
            grown = self._engine_totals.advance({
                "preemptions": stats.preemptions_total, "queries": stats.prefix_queries_tokens_total,
                "hits": stats.prefix_hits_tokens_total, "steps": stats.steps_total,
                "turn_hits": stats.conversation_hits_tokens_total,
                "turn_evictions": stats.conversation_evictions_total,
                "constrained": stats.constrained_tokens_total, "constraint_s": stats.constraint_seconds_total,
                "forced": stats.forced_tokens_total,
                "decode_steps": stats.decode_steps_total, "decode_s": stats.decode_seconds_total})
            self.constrained_tokens.inc(grown["constrained"])
            self.constraint_seconds.inc(grown["constraint_s"])
            self.forced_tokens.inc(grown["forced"])
            self.decode_steps.inc(grown["decode_steps"])
            self.decode_seconds.inc(grown["decode_s"])
            self.conversation_hits.inc(grown["turn_hits"])
            self.conversation_evictions.inc(grown["turn_evictions"])
            self.preemptions.labels(**labels).inc(grown["preemptions"])
            self.prefix_queries.labels(**labels).inc(grown["queries"])
            self.prefix_hits.labels(**labels).inc(grown["hits"])
            self.engine_steps.inc(grown["steps"])
            tokens = self.iteration_tokens.labels(**labels)
            for step in steps:
                tokens.observe(step.num_tokens)
                self.batch_size.observe(step.batch_size)
            self.engine = EngineView(kv_blocks_total=stats.kv_blocks_total,
                                     kv_block_tokens=stats.kv_block_tokens,
                                     last_step=steps[-1] if steps else self.engine.last_step)


@dataclass(frozen=True, slots=True)
class EngineView:
    """What the engine series cannot say and the dashboard shows: the pool's size, and the last
    step seen (None before the first)."""

    kv_blocks_total: int = 0
    kv_block_tokens: int = 0
    last_step: StepRecord | None = None


class TotalsTracker:
    """Turns snapshot totals (counts since the engine started) into increments for Prometheus
    counters, which can only be increased. A total below the last one seen means the counting
    restarted (a new engine): its whole value is new."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def advance(self, totals: dict[str, float]) -> dict[str, float]:
        grown = {}
        for name, total in totals.items():
            last = self._last.get(name, 0)
            grown[name] = total - last if total >= last else total
            self._last[name] = total
        return grown
