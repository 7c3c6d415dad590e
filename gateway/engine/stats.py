"""What the engine reports about itself: read by the metrics collector and the dashboard through
`Engine.stats()` and `Engine.drain_steps()`, never through the engine's members."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass


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
    decode_steps_total: int = 0  # batched decode forwards
    decode_seconds_total: float = 0.0  # their time (the model's forward, one token per sequence)
    memory: MemoryUse | None = None  # None: the engine did not say (ModelRunner.memory() does)

    @property
    def kv_usage(self) -> float:
        """Used blocks over all blocks, 0..1 (vLLM's kv_cache_usage_perc)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step of the loop: how many sequences it advanced and how many tokens it computed."""

    batch_size: int  # sequences that got a token of output or of prefill this step
    num_tokens: int  # decode tokens + prefill chunk tokens
    seconds: float


class StepLog:
    """Steps since the last drain (bounded), for the metrics collector's histograms."""

    def __init__(self, maxlen: int = 4096) -> None:
        self._steps: deque[StepRecord] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def add(self, record: StepRecord) -> None:
        with self._lock:
            self._steps.append(record)

    def drain(self) -> list[StepRecord]:
        with self._lock:
            taken = list(self._steps)
            self._steps.clear()
            return taken
