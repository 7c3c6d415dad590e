"""Proxy mode's Prometheus metrics, one registry per app. The client-facing series keep the model
app's names (`toolkv_requests_total`, `toolkv_requests_in_flight`); what depends on where a
request went carries an `upstream` label (the configured base URL: a bounded set). Without
`_created` series, as the model app's (gateway/metrics.py turns them off for the process)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from gateway.metrics import LATENCY_BUCKETS, TTFT_BUCKETS


@dataclass(frozen=True, slots=True)
class Usage:
    """What an upstream reported of a request's prompt; `cached_tokens` None when it said nothing."""

    prompt_tokens: int
    cached_tokens: int | None

    @property
    def result(self) -> str:
        if self.cached_tokens is None:
            return "unknown"
        return "hit" if self.cached_tokens > 0 else "miss"


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        self.requests = Counter("toolkv_requests_total", "Generation requests by the status the client got",
                                ["status", "stream"], registry=r)
        self.in_flight = Gauge("toolkv_requests_in_flight", "Requests being served", registry=r)
        self.upstream_requests = Counter("toolkv_upstream_requests_total",
                                         "Requests sent to an upstream, by its answer: an HTTP status, "
                                         "'error' (no answer, or a stream that ended before its first event), "
                                         "'broken' (a stream that broke off after it)",
                                         ["upstream", "status"], registry=r)
        self.routed = Counter("toolkv_upstream_routed_total",
                              "Requests by upstream and why they went there: home (the group's), spill (the "
                              "group's second choice: its home was over upstream_max_in_flight), failover (its "
                              "home is believed down), retry (an earlier upstream failed this request), turn "
                              "(upstream_routing = round_robin), stored (a Responses follow-up, to where its "
                              "previous response is stored)",
                              ["upstream", "route"], registry=r)
        self.upstream_in_flight = Gauge("toolkv_upstream_in_flight", "Requests in flight per upstream",
                                        ["upstream"], registry=r)
        self.upstream_up = Gauge("toolkv_upstream_up",
                                 "1 when the upstream's last request or health check reached it, else 0",
                                 ["upstream"], registry=r)
        self.cache_lookups = Counter("toolkv_cache_lookups_total",
                                     "Upstream prefix-cache results from usage.prompt_tokens_details.cached_tokens: "
                                     "hit (> 0), miss (0), unknown (not reported)", ["result", "upstream"],
                                     registry=r)
        self.prompt_tokens = Counter("toolkv_prompt_tokens_total", "Prompt tokens the upstreams reported",
                                     ["upstream"], registry=r)
        self.cached_tokens = Counter("toolkv_prompt_tokens_cached_total",
                                     "Prompt tokens the upstreams served from their prefix cache",
                                     ["upstream"], registry=r)
        self.ttft = Histogram("toolkv_time_to_first_token_seconds",
                              "Streams: time from the request's arrival to the upstream's first event",
                              ["cache", "upstream"], buckets=TTFT_BUCKETS, registry=r)
        self.latency = Histogram("toolkv_e2e_request_latency_seconds", "End-to-end request latency",
                                 ["cache", "upstream"], buckets=LATENCY_BUCKETS, registry=r)

    def observe_usage(self, upstream: str, usage: Usage | None) -> str:
        """Count what the upstream said of its cache; the lookup result ('unknown' without usage)."""
        usage = usage or Usage(prompt_tokens=0, cached_tokens=None)
        self.cache_lookups.labels(result=usage.result, upstream=upstream).inc()
        self.prompt_tokens.labels(upstream=upstream).inc(usage.prompt_tokens)
        self.cached_tokens.labels(upstream=upstream).inc(usage.cached_tokens or 0)
        return usage.result
