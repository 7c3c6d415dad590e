"""One proxied request's accounting: filled in as it goes (where it went, what the upstream
reported), written once when it ends as metrics and the request's INFO line."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from gateway.proxy.metrics import ProxyMetrics, Usage

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Exchange:
    metrics: ProxyMetrics
    request_id: str
    group_id: str
    stream: bool
    received: float  # perf_counter at arrival
    upstream: str = ""
    attempts: int = 0
    usage: Usage | None = None
    first_event_at: float | None = None  # streams: when the upstream's first event arrived

    def finish(self, status: int | str) -> None:
        """Count the request with the status the client got; a 200's cache result and times."""
        m, status = self.metrics, str(status)
        m.requests.labels(status=status, stream=str(self.stream).lower()).inc()
        latency_s = time.perf_counter() - self.received
        ttft_s = self.first_event_at - self.received if self.first_event_at is not None else None
        cache = None
        if status == "200":
            cache = m.observe_usage(self.upstream, self.usage)
            m.latency.labels(cache=cache, upstream=self.upstream).observe(latency_s)
            if ttft_s is not None:
                m.ttft.labels(cache=cache, upstream=self.upstream).observe(ttft_s)
        usage = self.usage
        log.info("request done", extra={"toolkv": {
            "request_id": self.request_id, "group_id": self.group_id, "upstream": self.upstream,
            "attempts": self.attempts, "status": status, "cache": cache,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": usage.cached_tokens if usage else None,
            "ttft_ms": round(ttft_s * 1000, 1) if ttft_s is not None else None,
            "latency_ms": round(latency_s * 1000, 1)}})
