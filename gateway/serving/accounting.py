"""Accounting: what a request's answer is measured by (TTFT, latency, tokens, cache result), into
the Prometheus metrics and the request log line."""

from __future__ import annotations

import logging
import time

from gateway.engine import EngineEvent, Finished, Prefilled, TextDelta
from gateway.metrics import Metrics
from gateway.serving.jobs import Outcome, Prepared

log = logging.getLogger("gateway.serving.service")  # the request log's logger, as operators filter it


class Accounting:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def observe(self, prepared: Prepared, outcome: Outcome, event: EngineEvent) -> None:
        if isinstance(event, Prefilled):
            outcome.prefilled = event
        elif isinstance(event, TextDelta):
            outcome.generated = event.tokens
            if outcome.ttft_s is None:
                outcome.ttft_s = time.perf_counter() - prepared.started
        elif isinstance(event, Finished):
            outcome.finish = event
            if outcome.ttft_s is None:
                outcome.ttft_s = time.perf_counter() - prepared.started

    def record(self, prepared: Prepared, outcome: Outcome, status: str, stream: bool) -> None:
        m, pre = self.metrics, outcome.prefilled
        m.requests.labels(status=status, stream=str(stream).lower()).inc()
        if pre is None:
            log.info("request done", extra={"toolkv": {
                "request_id": prepared.request_id, "group_id": prepared.group_id, "status": status,
                "latency_ms": round((time.perf_counter() - prepared.started) * 1000, 1)}})
            return
        m.cache_lookups.labels(result=pre.result, tier=pre.tier or "none").inc()
        m.prompt_tokens.inc(pre.prompt_tokens)
        m.cached_tokens.inc(pre.cached_tokens)
        m.computed_tokens.inc(pre.prompt_tokens - pre.cached_tokens)
        if pre.result == "miss":
            m.compile_seconds.observe(pre.compile_s)
        if pre.result == "hit":
            m.restore_seconds.observe(pre.restore_s)
        completion = outcome.completion_tokens  # a client that left: the tokens generated for it
        m.generated_tokens.inc(completion)
        if outcome.ttft_s is not None:
            m.observe_ttft(pre.result, outcome.ttft_s)
        total_s = time.perf_counter() - prepared.started
        m.latency.labels(cache=pre.result).observe(total_s)
        log.info("request done", extra={"toolkv": {
            "request_id": prepared.request_id, "group_id": prepared.group_id, "prompt_tokens": pre.prompt_tokens,
            "cached_tokens": pre.cached_tokens, "completion_tokens": completion,
            "cache": pre.result, "ttft_ms": round((outcome.ttft_s or 0) * 1000, 1),
            "latency_ms": round(total_s * 1000, 1), "status": status}})
