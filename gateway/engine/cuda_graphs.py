"""CUDA graphs for the engine's two common steps, captured at start-up.

A step with the Triton backend launches a few thousand small kernels (transformers' modules, one
op at a time): ~35 ms of host time per forward of an 8B model on the kit's H100, whatever its
size. Steps whose launch shapes depend only on a bucket size are captured once and replayed:
- a decode step of B rows, one token each (buckets 1, 2, 4, 8, then every 8 up to `max_batch`);
- a prompt chunk of one sequence alone, up to `PREFILL_BUCKETS[-1]` tokens (a hit's suffix, an
  agent's new messages), padded up to its bucket.
The host writes the step's token ids, positions, pool slots and KV layout into static buffers and
replays one graph. Padding rows and tokens write and read one scratch token of the pool
(`BlockPool.scratch_token`), so they never touch a sequence's KV; padding tokens are rows of their
own in every matrix product and never reach a real row. The bucket, and so every kernel's shape,
is a function of the step's token count alone: a chunk served alone runs the same graph on a hit,
a miss and a bypass. Larger chunks and mixed steps run eagerly.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from gateway.engine import attention
from gateway.engine.attention import KVLayout
from gateway.engine.model_runner import ModelRunner, RowKV, StepInputs, layout_columns

log = logging.getLogger(__name__)

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)


def buckets(max_rows: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_rows] + list(range(8, max_rows, 8))
    return sorted({*sizes, max_rows})


def pool_bytes(segments: list[dict[str, Any]], pool_id: Any) -> int:
    """Bytes of the segments (`torch.cuda.memory_snapshot()`'s) that the memory pool `pool_id` (a
    graph's `pool()`) holds; 0 when none matches."""
    if pool_id is None:
        return 0
    wanted = tuple(pool_id)
    return sum(int(s["total_size"]) for s in segments if tuple(s.get("segment_pool_id", ())) == wanted)


class StepGraphs:
    def __init__(self, runner: ModelRunner, max_rows: int) -> None:
        self.runner = runner
        self.max_rows = max_rows
        self.decode_sizes = buckets(max_rows)
        self.prefill_sizes = [b for b in PREFILL_BUCKETS if b < runner.pool.scratch_token]
        width = max(max_rows, *self.prefill_sizes, 1)
        device = runner.device
        self._ids = torch.zeros((1, width), dtype=torch.long, device=device)
        self._positions = torch.zeros((1, width), dtype=torch.long, device=device)
        self._slots = torch.zeros(width, dtype=torch.long, device=device)
        self._last = torch.zeros(1, dtype=torch.long, device=device)
        self._table = torch.zeros((7, max_rows), dtype=torch.int32, device=device)  # layout columns, rows
        tiles = -(-width // attention.PREFILL_BLOCK_M)
        self._tiles = torch.stack([torch.zeros(tiles, dtype=torch.int32),
                                   torch.arange(tiles, dtype=torch.int32) * attention.PREFILL_BLOCK_M]).to(device)
        self._decode: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._prefill: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_bytes = 0  # the graphs' private memory pool, once captured

    def fits_decode(self, rows: int) -> bool:
        return rows <= self.max_rows

    def fits_prefill(self, tokens: int) -> bool:
        return bool(self.prefill_sizes) and 1 < tokens <= self.prefill_sizes[-1]

    def capture(self) -> None:
        """Capture every bucket, the largest first (its memory pool serves the smaller ones)."""
        started = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.runner.device)
        self._fill_padding()
        pool = None
        for size in reversed(self.prefill_sizes):
            step = StepInputs([], [size], self.runner.pool, self._prefill_layout(size), self._slots[:size])
            pool = self._capture(self._prefill, size, step, self._last, pool)
        for size in reversed(self.decode_sizes):
            step = StepInputs([], [1] * size, self.runner.pool, self._decode_layout(size), self._slots[:size])
            pool = self._capture(self._decode, size, step, None, pool)
        torch.cuda.synchronize()
        segments = torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        # Else the memory reserved while capturing (it also counts the eager warm passes' cached blocks).
        self.num_bytes = (pool_bytes(segments, pool) or
                          max(0, torch.cuda.memory_reserved(self.runner.device) - reserved))
        log.info("captured %d CUDA graphs (decode batch 1-%d, prompt chunks up to %d tokens) in %.1fs, %.0f MiB",
                 len(self._decode) + len(self._prefill), self.max_rows, max(self.prefill_sizes, default=0),
                 time.perf_counter() - started, self.num_bytes / 2**20)

    def _capture(self, into: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]], size: int, step: StepInputs,
                 last: torch.Tensor | None, pool: Any) -> Any:
        args = (self._ids[:, :size], self._positions[:, :size], step, last)
        self.runner.run(*args)  # compiles kernels, settles the allocator
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool):
            logits = self.runner.run(*args)
        into[size] = (graph, logits)
        return graph.pool() if pool is None else pool

    def replay_decode(self, tokens: list[int], rows: list[RowKV], ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[len(rows), vocab]` for one decode token per row (`ids`: the tokens already on
        the device, copied in after `tokens`' placeholders, in stream order)."""
        count = len(rows)
        size = next(s for s in self.decode_sizes if s >= count)
        pad, scratch = size - count, self.runner.pool.scratch_token
        self._inputs(tokens + [0] * pad, [row.position for row in rows] + [0] * pad,
                     [row.own.token_start + row.own_len for row in rows] + [scratch] * pad)
        if ids is not None:
            self._ids[0, :count].copy_(ids)
        columns = layout_columns(rows, [1] * count)
        padding = [list(range(count, size)), [1] * pad, [0] * pad, [0] * pad, [scratch] * pad, [1] * pad]
        table = torch.tensor([c + p for c, p in zip(columns, padding, strict=True)] + [list(range(size))],
                             dtype=torch.int32, pin_memory=True)
        self._table[:, :size].copy_(table, non_blocking=True)
        graph, logits = self._decode[size]
        graph.replay()
        return logits[:count]

    def replay_prefill(self, tokens: list[int], row: RowKV) -> torch.Tensor:
        """Logits `[1, vocab]` after a prompt chunk of one sequence alone."""
        count = len(tokens)
        size = next(s for s in self.prefill_sizes if s >= count)
        pad, scratch = size - count, self.runner.pool.scratch_token
        start = row.own.token_start + row.own_len
        self._inputs(tokens + [0] * pad, list(range(row.position, row.position + count)) + [0] * pad,
                     list(range(start, start + count)) + [scratch] * pad)
        self._last.fill_(count - 1)
        table = torch.tensor([c[0] for c in layout_columns([row], [count])] + [0], dtype=torch.int32, pin_memory=True)
        self._table[:, 0].copy_(table, non_blocking=True)
        graph, logits = self._prefill[size]
        graph.replay()
        return logits

    def _inputs(self, ids: list[int], positions: list[int], slots: list[int]) -> None:
        size = len(ids)
        # Pinned: a copy from pageable memory may wait for the work queued before it, and a decode
        # step launched ahead (engine/core.py) must not wait for the step in flight.
        host = torch.tensor([ids, positions, slots], dtype=torch.long, pin_memory=True)
        self._ids[0, :size].copy_(host[0], non_blocking=True)
        self._positions[0, :size].copy_(host[1], non_blocking=True)
        self._slots[:size].copy_(host[2], non_blocking=True)

    def _decode_layout(self, size: int) -> KVLayout:
        t = self._table
        empty = torch.zeros(0, dtype=torch.int32, device=t.device)
        return KVLayout(t[0, :size], t[1, :size], t[2, :size], t[3, :size], t[4, :size], t[5, :size],
                        decode_rows=t[6, :size], tile_seq=empty, tile_first=empty, num_decode=size, num_tiles=0)

    def _prefill_layout(self, size: int) -> KVLayout:
        t = self._table
        tiles = -(-size // attention.PREFILL_BLOCK_M)
        return KVLayout(t[0, :1], t[1, :1], t[2, :1], t[3, :1], t[4, :1], t[5, :1], decode_rows=t[6, :0],
                        tile_seq=self._tiles[0, :tiles], tile_first=self._tiles[1, :tiles], num_decode=0,
                        num_tiles=tiles)

    def _fill_padding(self) -> None:
        """Every row a padding row (scratch token), for capture."""
        scratch = self.runner.pool.scratch_token
        rows = torch.arange(self.max_rows, dtype=torch.int32, device=self._table.device)
        self._table[0].copy_(rows)
        self._table[1].fill_(1)
        self._table[2].zero_()
        self._table[3].zero_()
        self._table[4].fill_(scratch)
        self._table[5].fill_(1)
        self._table[6].copy_(rows)
        self._slots.fill_(scratch)
