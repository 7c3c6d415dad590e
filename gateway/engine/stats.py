"""What the engine reports about itself, and how it times its device's work (`DeviceSpan`).

The metrics collector and the dashboard read the engine and its prefix store through a `Snapshot`:
immutable, taken on the engine's thread between steps (`take_snapshot`, through `engine.call`), so
nothing outside the engine reads the RAM tier or the block pool while the engine changes them
(kvcache/block_pool.py's `Owner`); the runtime keeps the last one for a reader that cannot wait for the engine
(its queue is full: serving/runtime.py `Runtime.snapshot`). Steps are counted (`StepCounts`) and
go through `StepLog`, drained by the collector (its lock is the boundary between the engine's
thread and the collector's)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gateway.kvcache.store import EntryInfo, PrefixStore

if TYPE_CHECKING:
    from gateway.engine.core import Engine


@dataclass(frozen=True, slots=True)
class MemoryUse:
    """Bytes the engine holds on its device, by part: the model's weights (parameters and buffers),
    the KV block pool (allocated once at start-up, whatever is in it), and the private memory pool
    of the CUDA graphs captured at start-up (0 without graphs: the CPU, the torch backend)."""

    weights_bytes: int
    kv_pool_bytes: int
    cuda_graphs_bytes: int = 0

    def parts(self) -> dict[str, int]:
        """{part: bytes}, the parts as `toolkv_memory_bytes{part}` names them."""
        return {"weights": self.weights_bytes, "kv_pool": self.kv_pool_bytes, "cuda_graphs": self.cuda_graphs_bytes}


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot. Gauges are as of now; `*_total` fields are counts since start."""

    running: int  # sequences in the batch (prefilling or decoding)
    waiting: int  # accepted, not yet admitted to the batch
    kv_blocks_total: int  # the KV block pool's size in blocks
    kv_blocks_used: int  # held by running sequences or cached prefixes
    kv_blocks_cached: int  # of those, held only by cached prefixes (reclaimable)
    kv_block_tokens: int  # tokens per block
    preemptions_total: int
    prefix_queries_tokens_total: int  # prompt tokens looked up in the prefix cache
    prefix_hits_tokens_total: int  # of those, served from cached blocks
    steps_total: int
    cancelled_total: int  # sequences stopped because their client went away
    conversation_records: int = 0  # earlier prompts kept for their conversation's next turn
    conversation_blocks: int = 0  # pool blocks those hold (part of kv_blocks_cached)
    conversation_hits_tokens_total: int = 0  # prompt tokens served from an earlier turn's KV
    conversation_evictions_total: int = 0  # records dropped to make room in the pool
    constrained_tokens_total: int = 0  # tokens chosen under a grammar (constraints.py)
    constraint_seconds_total: float = 0.0  # the grammar's time for those: masks and following
    forced_tokens_total: int = 0  # of those, tokens the grammar forced (fed to the model in chunks)
    decode_steps_total: int = 0  # batched decode forwards
    decode_seconds_total: float = 0.0  # their time (the model's forward, one token per sequence)
    memory: MemoryUse | None = None  # None: the engine did not say (ModelRunner.memory() does)

    @property
    def kv_usage(self) -> float:
        """Used blocks over all blocks, 0..1 (vLLM's kv_cache_usage_perc)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True, slots=True)
class StoreStats:
    """The prefix store's RAM tier as of a snapshot (the disk tier and the pins are read where
    they are: they have their own locks)."""

    ram_entries: int
    ram_bytes: int
    listing: tuple[EntryInfo, ...]  # the RAM tier's entries, most recently used first


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The engine and its store at one moment between steps."""

    engine: EngineStats
    store: StoreStats
    taken_at: float  # time.time()


def take_snapshot(engine: Engine, store: PrefixStore) -> Snapshot:
    """Run on the engine's thread (`engine.call`), or where no engine runs."""
    engine.pool.reclaim()  # blocks the disk writer handed back count as free
    ram = store.ram
    return Snapshot(engine.stats(), StoreStats(len(ram), ram.num_bytes, tuple(store.ram_entries())), time.time())


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step of the loop: how many sequences it advanced and how many tokens it computed."""

    batch_size: int  # sequences that got a token of output or of prefill this step
    num_tokens: int  # decode tokens + prefill chunk tokens
    seconds: float


class DeviceSpan:
    """How long a piece of the device's work took. On CUDA a launch returns before the work is
    done, so timing it on the host measures the launch: there the span is two CUDA events recorded
    around the launches, and its `seconds` are the device's time between them (read once the work
    is done: `seconds` waits for the end event, which costs nothing once something later was read).
    On the CPU a launch is the work, and the span is the host's clock from its start to `end`."""

    __slots__ = ("_end", "_seconds", "_start", "_started")

    def __init__(self, device: torch.device) -> None:
        self._started = time.perf_counter()
        self._start: Any = None
        self._end: Any = None
        self._seconds: float | None = None
        if device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            self._start.record()

    def end(self) -> DeviceSpan:
        """The work launched since the start is the span's (no wait)."""
        if self._start is None:
            self._seconds = time.perf_counter() - self._started
        else:
            self._end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            self._end.record()
        return self

    def wait(self) -> None:
        """Wait until the span's work is done on the device (no wait on the CPU)."""
        if self._end is not None:
            self._end.synchronize()

    def seconds(self) -> float:
        if self._seconds is None:
            assert self._end is not None, "end() first"
            self._end.synchronize()
            self._seconds = float(self._start.elapsed_time(self._end)) / 1000
        return self._seconds


class StepLog:
    """Steps since the last drain (bounded), for the metrics collector's histograms. A step timed by
    a `DeviceSpan` is read when drained (on the collector's thread): the engine never waits for it."""

    def __init__(self, maxlen: int = 4096) -> None:
        self._steps: deque[StepRecord | tuple[int, int, DeviceSpan]] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def add(self, record: StepRecord) -> None:
        with self._lock:
            self._steps.append(record)

    def add_span(self, batch_size: int, num_tokens: int, span: DeviceSpan) -> None:
        with self._lock:
            self._steps.append((batch_size, num_tokens, span))

    def drain(self) -> list[StepRecord]:
        with self._lock:
            taken = list(self._steps)
            self._steps.clear()
        return [step if isinstance(step, StepRecord) else StepRecord(step[0], step[1], step[2].seconds())
                for step in taken]


@dataclass(slots=True)
class StepCounts:
    """The steps run since start (the engine's stats) and those not drained yet (its step log)."""

    log: StepLog = field(default_factory=StepLog)
    steps: int = 0
    decode_steps: int = 0
    decode_s: float = 0.0

    def add(self, rows: int, tokens: int, decode_s: float | None, span: DeviceSpan | None = None) -> None:
        """A step of `rows` rows and `tokens` tokens; `decode_s`: its time when it had decode rows;
        `span`: its device time (else `decode_s` is)."""
        self.steps += 1
        if decode_s is not None:
            self.decode_steps += 1
            self.decode_s += decode_s
        if span is not None:
            self.log.add_span(rows, tokens, span)
        else:
            self.log.add(StepRecord(rows, tokens, decode_s or 0.0))
