"""The floor: what a hit cannot go below. The bench loads the same model in its own process
(after the HTTP scenarios, so the two never compete for the CPU), compiles the group's prefix
once, then times what a hit must do on the engine thread — restore the prefix KV and prefill the
suffix — for the same requests the scenarios sent.

Also timed, to show where a hit's overhead goes: `prepare` (render + tokenize, in the server's
event loop) and the engine's own hit prefill through a real job (adds key hash and lookup).
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Any

from gateway.settings import Settings


class FloorError(RuntimeError):
    """The floor cannot be measured for this group; the message says why."""


@dataclass(frozen=True, slots=True)
class FloorResult:
    group: str
    num_tools: int
    prefix_tokens: int
    suffix_tokens: int
    compile_s: float
    floor_ms: tuple[float, ...]  # restore + suffix prefill, one per question
    restore_ms: tuple[float, ...]
    prepare_ms: tuple[float, ...]
    engine_hit_ms: tuple[float, ...]


def measure_floors(settings: Settings, bodies_by_group: dict[str, list[dict[str, Any]]]) -> dict[str, FloorResult]:
    """Load the model once and measure the floor for each group (bodies: its requests)."""
    from gateway.metrics import Metrics
    from gateway.runtime import build_runtime

    runtime = build_runtime(settings.model_copy(update={"disk_budget_bytes": 0}), Metrics())
    try:
        return {label: _measure(runtime, label, bodies) for label, bodies in bodies_by_group.items()}
    finally:
        runtime.engine.stop()


def _measure(runtime: Any, label: str, bodies: list[dict[str, Any]]) -> FloorResult:
    from gateway.protocol import ChatCompletionRequest

    service, engine = runtime.service, runtime.engine
    prepare_ms: list[float] = []
    jobs = []
    for body in bodies:
        started = time.perf_counter()
        jobs.append(service.prepare(ChatCompletionRequest.model_validate({**body, "max_tokens": 1})).job)
        prepare_ms.append(_ms_since(started))
    first = jobs[0]
    if first.prefix_len < engine.min_prefix_tokens or first.prefix_len >= len(first.prompt_ids):
        raise FloorError(f"group {label}: no cacheable prefix ({first.prefix_len} tokens)")
    key = engine.key_for(first.prompt_ids[: first.prefix_len])
    entry = engine.call(lambda: engine.compile_prefix(key, first.group_id, first.tool_names)).result()
    engine.call(lambda: _time_hit(engine, entry, first)).result()  # warm-up, not counted
    timings = [engine.call(lambda job=job: _time_hit(engine, entry, job)).result() for job in jobs]
    return FloorResult(
        group=label, num_tools=len(first.tool_names), prefix_tokens=first.prefix_len,
        suffix_tokens=len(first.prompt_ids) - first.prefix_len, compile_s=round(entry.compile_s, 3),
        floor_ms=tuple(total for _, total in timings), restore_ms=tuple(restore for restore, _ in timings),
        prepare_ms=tuple(prepare_ms), engine_hit_ms=tuple(_engine_hit_ms(engine, job) for job in jobs))


def _time_hit(engine: Any, entry: Any, job: Any) -> tuple[float, float]:
    """On the engine thread: (restore ms, restore + suffix prefill ms)."""
    started = time.perf_counter()
    cache = engine.restore(entry)
    restored = _ms_since(started)
    engine._forward(job.prompt_ids[job.prefix_len :], cache)  # the hit path's own suffix prefill
    return restored, _ms_since(started)


def _engine_hit_ms(engine: Any, job: Any) -> float:
    """Run the job through the engine's queue; return its own prefill time (a hit)."""
    from gateway.engine import Failed, Finished, Prefilled

    events: queue.Queue[Any] = queue.Queue()
    job.emit = events.put
    engine.submit(job)
    prefill_ms = float("nan")
    while not isinstance(event := events.get(timeout=600), (Finished, Failed)):
        if isinstance(event, Prefilled):
            if event.result != "hit":
                raise FloorError(f"the floor's own request was a {event.result}, not a hit")
            prefill_ms = event.prefill_s * 1000
    if isinstance(event, Failed):
        raise FloorError(event.message)
    return prefill_ms


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)
