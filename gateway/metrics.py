"""Prometheus metrics, one registry per app (no module-level state). Names follow Prometheus
conventions: counters end in `_total`, units in names, bounded label values only."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# The same buckets as vLLM's time_to_first_token_seconds, so dashboards line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
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
        self.evictions = Counter("toolkv_cache_evictions_total", "Entries evicted per tier",
                                 ["tier"], registry=r)
        self.cache_errors = Counter("toolkv_cache_errors_total",
                                    "Cache faults (corrupt file, disk full...) handled as a miss",
                                    ["kind"], registry=r)
        self.queue_depth = Gauge("toolkv_queue_depth", "Requests waiting for the engine", registry=r)
        self.in_flight = Gauge("toolkv_requests_in_flight", "Requests being served", registry=r)
        self.model_loaded = Gauge("toolkv_model_loaded",
                                  "Model load state: 0 loading, 1 ready, -1 failed", registry=r)
        self.tool_parse_failures = Counter("toolkv_tool_call_parse_failures_total",
                                           "Model outputs that looked like tool calls but did not parse",
                                           registry=r)
