"""Tenants share the engine fairly: one key's many long answers neither make another key's short
request wait on all of their work every step, nor queue ahead of it for a batch slot; and what
each request generates is the same as alone."""

from __future__ import annotations

import threading
from collections.abc import Callable

from gateway.engine import EngineEvent, Finished, Job, Prefilled, TextDelta
from gateway.engine.sampling import SamplingParams
from gateway.serving.runtime import Runtime

TIMEOUT_S = 300


class Trace:
    """Every event of every job, in the order the engine thread emitted them."""

    def __init__(self) -> None:
        self.events: list[tuple[str, EngineEvent]] = []
        self._changed = threading.Condition()

    def job(self, runtime: Runtime, label: str, tenant: str, max_tokens: int, seed: int = 0) -> Job:
        """A greedy job of `tenant` that never stops early (its end-of-sequence tokens banned)."""
        never_stop = tuple((eos, -100.0) for eos in sorted(runtime.engine.info.eos_ids))
        params = SamplingParams(max_tokens=max_tokens, temperature=0, logit_bias=never_stop)
        prompt = [(17 * seed + 31 * i) % 200 + 10 for i in range(12 + seed)]
        return Job(prompt, 0, params, emit=self._emitter(label), tenant=tenant)

    def _emitter(self, label: str) -> Callable[[EngineEvent], None]:
        def emit(event: EngineEvent) -> None:
            with self._changed:
                self.events.append((label, event))
                self._changed.notify_all()
        return emit

    def wait_until(self, done: Callable[[], bool]) -> None:
        with self._changed:
            assert self._changed.wait_for(done, TIMEOUT_S), "the engine never got there"

    def wait(self, *labels: str) -> None:
        self.wait_until(lambda: all(self.count(label, Finished) for label in labels))

    def count(self, prefix: str, kind: type) -> int:
        return sum(1 for who, event in self.events if who.startswith(prefix) and isinstance(event, kind))

    def index(self, label: str, kind: type) -> int:
        return next(i for i, (who, event) in enumerate(self.events) if who == label and isinstance(event, kind))

    def tokens(self, label: str) -> tuple[int, ...]:
        return next(e.token_ids for who, e in self.events if who == label and isinstance(e, Finished))


def test_one_tenant_cannot_starve_another_in_the_engine(runtime_for: Callable[..., Runtime]) -> None:
    """Key A has six long answers decoding when key B sends a short one: B waits for about as much of
    A's work as its own (a share each), not for all six of A's rows at every one of its steps."""
    runtime = runtime_for("llama")
    trace = Trace()
    a_jobs = [trace.job(runtime, f"a{i}", "tenant-a", max_tokens=80, seed=i) for i in range(6)]
    for job in a_jobs:
        runtime.engine.submit(job)
    trace.wait_until(lambda: trace.count("a", TextDelta) >= 12)  # A's six are decoding
    b_job = trace.job(runtime, "b", "tenant-b", max_tokens=6, seed=9)
    runtime.engine.submit(b_job)
    trace.wait("b")
    during_b = trace.events[trace.index("b", Prefilled):trace.index("b", Finished)]
    a_deltas = sum(1 for who, e in during_b if who.startswith("a") and isinstance(e, TextDelta))
    assert a_deltas <= 2 * 6, f"A got {a_deltas} tokens out while B's 6 were made"
    trace.wait(*(f"a{i}" for i in range(6)))
    for i, job in enumerate(a_jobs):  # and nobody's tokens changed for it
        alone = Trace()
        runtime.engine.submit(alone.job(runtime, "x", "tenant-a", max_tokens=80, seed=i))
        alone.wait("x")
        assert alone.tokens("x") == trace.tokens(f"a{i}")
        assert len(trace.tokens(f"a{i}")) == job.params.max_tokens


def test_one_tenants_backlog_does_not_queue_ahead_of_another_tenant(runtime_for: Callable[..., Runtime]) -> None:
    """Two batch slots, key A's six requests sent first: key B's request, sent after them, gets a
    slot once A has one running (at the latest the first that frees), not after A's whole backlog."""
    runtime = runtime_for("llama", max_batch=2)
    trace = Trace()
    for i in range(6):
        runtime.engine.submit(trace.job(runtime, f"a{i}", "tenant-a", max_tokens=20, seed=i))
    runtime.engine.submit(trace.job(runtime, "b", "tenant-b", max_tokens=4, seed=9))
    trace.wait("b", *(f"a{i}" for i in range(6)))
    b_admitted = trace.index("b", Prefilled)
    a_before_b = [who for who, e in trace.events[:b_admitted] if isinstance(e, Prefilled)]
    assert len(a_before_b) <= 2, a_before_b  # FIFO would have all six of A's first
