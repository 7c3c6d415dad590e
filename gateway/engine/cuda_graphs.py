"""CUDA graphs for decode steps: one graph per batch-size bucket, captured at start-up.

A decode step with the Triton backend launches a few hundred kernels whose shapes depend only on
the number of rows, so it is captured once per bucket (1, 2, 4, 8, then every 8 up to the largest
batch) and replayed: the host writes the step's token ids, positions, pool slots and KV layout
into static buffers and launches one graph. A batch is padded up to its bucket with rows that
write and read one scratch token of the pool (`BlockPool.scratch_token`), so padding never touches
a sequence's KV. Prompt chunks and batches above the largest bucket run eagerly.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from gateway.engine.attention import KVLayout

if TYPE_CHECKING:
    from gateway.engine.model_runner import ModelRunner, RowKV

log = logging.getLogger(__name__)


def buckets(max_rows: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_rows] + list(range(8, max_rows, 8))
    return sorted({*sizes, max_rows})


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_rows: int) -> None:
        self.runner = runner
        self.max_rows = max_rows
        self.sizes = buckets(max_rows)
        device = runner.device
        self._ids = torch.zeros((1, max_rows), dtype=torch.long, device=device)
        self._positions = torch.zeros((1, max_rows), dtype=torch.long, device=device)
        self._slots = torch.zeros(max_rows, dtype=torch.long, device=device)
        self._table = torch.zeros((7, max_rows), dtype=torch.int32, device=device)  # layout columns, rows
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, rows: int) -> bool:
        return rows <= self.max_rows

    def capture(self) -> None:
        """Capture every bucket, the largest first (its memory pool serves the smaller ones)."""
        from gateway.engine.model_runner import StepInputs

        started = time.perf_counter()
        self._fill_padding(0)
        pool = None
        for size in reversed(self.sizes):
            step = StepInputs([], [1] * size, self.runner.pool, self._layout(size), self._slots[:size])
            args = (self._ids[:, :size], self._positions[:, :size], step, None)
            self.runner.run(*args)  # compiles the kernels and settles the allocator before capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                logits = self.runner.run(*args)
            pool = graph.pool() if pool is None else pool
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (batch 1-%d) in %.1fs", len(self.sizes), self.max_rows,
                 time.perf_counter() - started)

    def replay(self, tokens: list[int], rows: list[RowKV]) -> torch.Tensor:
        """Logits `[len(rows), vocab]` for one decode token per row."""
        from gateway.engine.model_runner import layout_columns

        count = len(rows)
        size = next(s for s in self.sizes if s >= count)
        scratch = self.runner.pool.scratch_token
        host = torch.tensor([tokens + [0] * (size - count),
                             [row.position for row in rows] + [0] * (size - count),
                             [row.own.token_start + row.own_len for row in rows] + [scratch] * (size - count)],
                            dtype=torch.long)
        columns = layout_columns(rows, [1] * count)
        pad = [list(range(count, size)), [1] * (size - count), [0] * (size - count), [0] * (size - count),
               [scratch] * (size - count), [1] * (size - count)]
        table = torch.tensor([c + p for c, p in zip(columns, pad, strict=True)] + [list(range(size))],
                             dtype=torch.int32)
        self._ids[0, :size].copy_(host[0], non_blocking=True)
        self._positions[0, :size].copy_(host[1], non_blocking=True)
        self._slots[:size].copy_(host[2], non_blocking=True)
        self._table[:, :size].copy_(table, non_blocking=True)
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:count]

    def _layout(self, size: int) -> KVLayout:
        t = self._table
        empty = torch.zeros(0, dtype=torch.int32, device=t.device)
        return KVLayout(t[0, :size], t[1, :size], t[2, :size], t[3, :size], t[4, :size], t[5, :size],
                        decode_rows=t[6, :size], tile_seq=empty, tile_first=empty, num_decode=size, num_tiles=0)

    def _fill_padding(self, count: int) -> None:
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
