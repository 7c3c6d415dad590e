"""The floor: what a hit cannot go below. The bench loads the same model in its own process
(after the scenarios, while the server idles), compiles a group's prefix once, then times what a
hit must do on the engine thread: restore the prefix KV and prefill the suffix.

It runs by default only for a server on another machine (`server_is_local`): beside the server on
the same cores the two slow each other down, so there only `--floor` measures it, labelled
unreliable. Each floor timing is paired with a real HTTP hit on the same group sent just before
it, so the overhead (HTTP TTFT - floor) compares two numbers taken under the same machine load.
Also timed: `prepare` (render + tokenize, in the server's event loop) and the engine's own hit
prefill through a queued job (adds key hash and lookup).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import queue
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gateway.bench.client import BenchClient, Sample
from gateway.bench.workload import ToolGroup, Workload
from gateway.metrics import Metrics
from gateway.protocol.chat import ChatCompletionRequest
from gateway.settings import Settings

FLOOR_DISABLED = "disabled with --no-floor"
FLOOR_QUICK = "not measured with --quick (--floor measures it)"
FLOOR_LOCAL = ("not measured: the server runs on this machine, where the floor would share its CPU "
               "(--floor measures it anyway, labelled unreliable)")


def server_is_local(base_url: str | None) -> bool:
    """Whether `base_url` names this machine (loopback, an unspecified address, this host's name or
    one of its addresses): a server there shares the cores an in-process floor would run on."""
    host = urlsplit(base_url or "").hostname
    if not host:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
        if address.is_loopback or address.is_unspecified:
            return True
    except ValueError:
        if host.lower() in {socket.gethostname().lower(), socket.getfqdn().lower()}:
            return True
    return bool(_addresses(host) & (_addresses(socket.gethostname()) | {"127.0.0.1", "::1"}))


def _addresses(host: str) -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return set()


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
    http_ttft_ms: tuple[float | None, ...] = ()  # the paired HTTP hit before each floor (None: not a hit)


class FloorProbe:
    """The model in this process (no disk tier), driven on its own engine thread."""

    def __init__(self, settings: Settings) -> None:
        # lazy: the runtime loads torch and transformers, only when the floor runs (not for --no-floor or a peer)
        from transformers.utils import logging as hf_logging

        from gateway.serving.runtime import build_runtime

        hf_logging.disable_progress_bar()  # the bench's own progress display owns the terminal
        previous = os.environ.get("TQDM_DISABLE")
        os.environ["TQDM_DISABLE"] = "1"  # transformers' GGUF conversion uses tqdm directly
        try:
            self.runtime = build_runtime(settings.model_copy(update={"disk_budget_bytes": 0}), Metrics())
        finally:
            if previous is None:
                del os.environ["TQDM_DISABLE"]
            else:
                os.environ["TQDM_DISABLE"] = previous
        self.engine = self.runtime.engine

    def close(self) -> None:
        self.engine.stop()

    def prepare(self, body: dict[str, Any]) -> tuple[Any, float]:
        """The engine job the server would build for `body`, and the time that took (ms)."""
        started = time.perf_counter()
        job = self.runtime.service.prepare(ChatCompletionRequest.model_validate({**body, "max_tokens": 1})).job
        return job, _ms_since(started)

    def compile(self, job: Any) -> Any:
        if job.prefix_len < self.engine.cache.min_prefix_tokens or job.prefix_len >= len(job.prompt_ids):
            raise FloorError(f"no cacheable prefix ({job.prefix_len} tokens)")
        key = self.engine.cache.key_for(job.prompt_ids[: job.prefix_len])
        return self.engine.warm(key, job.group_id, job.tool_names).result()[0]

    def time_hit(self, entry: Any, job: Any) -> tuple[float, float]:
        """(restore ms, restore + suffix prefill ms), timed on the engine thread."""
        return self.engine.call(lambda: _time_hit(self.engine, entry, job)).result()  # type: ignore[no-any-return]

    def engine_hit_ms(self, job: Any) -> float:
        """Run the job through the engine's queue; return its own prefill time (a hit)."""
        from gateway.engine import Failed, Finished, Prefilled  # lazy: the engine package loads torch

        events: queue.Queue[Any] = queue.Queue()
        job.emit = events.put
        self.engine.submit(job)
        prefill_ms = float("nan")
        while not isinstance(event := events.get(timeout=600), (Finished, Failed)):
            if isinstance(event, Prefilled):
                if event.result != "hit":
                    raise FloorError(f"the floor's own request was a {event.result}, not a hit")
                prefill_ms = event.prefill_s * 1000
        if isinstance(event, Failed):
            raise FloorError(event.message)
        return prefill_ms


async def measure_floor(probe: FloorProbe, client: BenchClient, workload: Workload, group: ToolGroup,
                        num_questions: int) -> FloorResult:
    """Alternate an HTTP hit on `group` with the floor of a fresh question on the same group."""
    first, _ = probe.prepare(workload.body(group, 1))
    entry = await asyncio.to_thread(probe.compile, first)
    await _http_hit(client, workload, group)  # the server may have evicted the group: warm it
    await asyncio.to_thread(probe.time_hit, entry, first)  # warm-up, not counted
    floors, restores, prepares, engine = [], [], [], []
    http: list[float | None] = []
    for _ in range(num_questions):
        sample = await _http_hit(client, workload, group)
        hit = sample.cache == "hit" and sample.ttft_s is not None
        http.append(round(sample.ttft_s * 1000, 3) if hit and sample.ttft_s is not None else None)
        job, prepare_ms = probe.prepare(workload.body(group, 1))
        restore_ms, floor_ms = await asyncio.to_thread(probe.time_hit, entry, job)
        floors.append(floor_ms)
        restores.append(restore_ms)
        prepares.append(prepare_ms)
        engine.append(await asyncio.to_thread(probe.engine_hit_ms, probe.prepare(workload.body(group, 1))[0]))
    return FloorResult(group=group.label, num_tools=group.num_tools, prefix_tokens=first.prefix_len,
                       suffix_tokens=len(first.prompt_ids) - first.prefix_len, compile_s=round(entry.compile_s, 3),
                       floor_ms=tuple(floors), restore_ms=tuple(restores), prepare_ms=tuple(prepares),
                       engine_hit_ms=tuple(engine), http_ttft_ms=tuple(http))


async def _http_hit(client: BenchClient, workload: Workload, group: ToolGroup) -> Sample:
    sample = Sample("floor", group.label, group.num_tools, group.offset, "hit", False, 0.0)
    return await client.chat(workload.body(group, 1), sample)


def _time_hit(engine: Any, entry: Any, job: Any) -> tuple[float, float]:
    """A hit restores nothing (it reads the group's blocks in place): restore is 0."""
    started = time.perf_counter()
    prefill_over(engine, entry, job.prompt_ids[job.prefix_len :])  # the hit path's own suffix prefill
    return 0.0, _ms_since(started)


def prefill_over(engine: Any, entry: Any, suffix_ids: list[int]) -> None:
    """What a hit computes: `suffix_ids` prefilled after the stored group, in the same chunks, into
    a scratch run that is freed after. Engine thread only."""
    # lazy: the engine (torch) loads only when the floor runs
    from gateway.engine.model_runner import RowKV
    from gateway.engine.prefix_index import chunk_ends, next_end

    run = engine.cache.allocate(len(suffix_ids))
    if run is None:
        raise FloorError("the KV pool has no room for the suffix now")
    try:
        group = [(layer.keys[0], layer.values[0]) for layer in entry.layers]
        group_start = entry.blocks.token_start if entry.blocks is not None else -1
        prompt, start = [*entry.key.token_ids, *suffix_ids], entry.num_tokens
        ends = chunk_ends(prompt, start, engine.scheduler.chunk_tokens, engine.cache.turn_opening)
        done = start
        while done < len(prompt):
            end = next_end(ends, done)
            engine.runner.forward([prompt[done:end]], [RowKV(group, run, done - start, done, group_start)])
            done = end
    finally:
        run.release()


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)
