"""CUDA graphs for the engine's steps, captured at start-up.

A step with the Triton backend launches hundreds of kernels (eight a decoder layer, with its
products), each a few microseconds of host time, more than a small step's device work. Steps whose
launch shapes depend only on a bucket are captured once and replayed:
- a decode step of B rows, one token each (buckets 1, 2, 4, 8, then every 8 up to `max_rows`);
- a step with prompt chunks of up to `cuda_graph_max_tokens` (512) in all, padded up to its bucket:
  one graph of chunks alone (a hit's suffix, an agent's new messages) and one of decode rows
  beside chunks (a new request joining running ones), per bucket. With `batch_invariant`, whose
  linears run per sequence, only a chunk alone is replayed, and an eager chunk's linears are
  padded to the rows its graph has (model_runner.py), so batched == alone still holds.
The host writes the step's token ids, positions and KV layout into static buffers and replays one
graph. Padding tokens belong to no sequence (nothing of theirs reaches the pool) and are rows of
their own in every matrix product; padding sequences (decode rows, prompt tiles)
point at a padding column of the layout with no queries and no keys, so they read nothing and
write no output. The bucket, and so every kernel's shape, is a function of the step's token count
(and whether it has decode rows) alone: a chunk served alone runs the same graph on a hit, a miss
and a bypass. Larger steps run eagerly.

Without CUDA (the test suite, on Triton's interpreter) a "graph" re-runs the captured step on the
same static buffers, so the buffers, padding and layouts are tested on every machine.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gateway.engine import attention
from gateway.engine.attention import KVLayout
from gateway.engine.model_runner import FlatStep, ModelRunner, RowKV, StepInputs, aligned, layout_columns

log = logging.getLogger(__name__)

def flat_buckets(max_tokens: int) -> tuple[int, ...]:
    """Token buckets of steps with prompt chunks: 16, 32, 64, ... up to `max_tokens`."""
    return tuple(16 << i for i in range(12) if 16 << i <= max_tokens)


def buckets(max_rows: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_rows] + list(range(8, max_rows, 8))
    return sorted({*sizes, max_rows})


def bucket_of(sizes: tuple[int, ...] | list[int], count: int) -> int | None:
    """The smallest of `sizes` that holds `count`, or None."""
    return next((size for size in sizes if size >= count), None)


def pool_bytes(segments: list[dict[str, Any]], pool_id: Any) -> int:
    """Bytes of the segments (`torch.cuda.memory_snapshot()`'s) that the memory pool `pool_id` (a
    graph's `pool()`) holds; 0 when none matches."""
    if pool_id is None:
        return 0
    wanted = tuple(pool_id)
    return sum(int(s["total_size"]) for s in segments if tuple(s.get("segment_pool_id", ())) == wanted)


class _Replayable(Protocol):
    def replay(self) -> None: ...


class _Rerun:
    """A step "captured" without CUDA, or whose capture failed: replaying runs it again on the same
    static buffers (the same padded shapes and kernels, so the same numbers as a graph would give:
    the cache key, which names the graphs, stays true)."""

    def __init__(self, run: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self._run = run
        self._out = out

    def replay(self) -> None:
        with torch.inference_mode():  # the logits are the model's (inference) tensor
            self._out.copy_(self._run())


@dataclass(frozen=True, slots=True)
class _Graph:
    """One captured step: the static logits its replay writes, and its launch capacities (decode
    rows, prompt tiles, sampled rows)."""

    replayable: _Replayable
    logits: torch.Tensor
    decode: int
    tiles: int
    sampled: int


class StepGraphs:
    def __init__(self, runner: ModelRunner, max_rows: int, flat_sizes: tuple[int, ...] = flat_buckets(512)) -> None:
        self.runner = runner
        self.max_rows = max_rows
        self.invariant = runner.batch_invariant
        self.decode_sizes = buckets(max_rows)
        self.flat_sizes = tuple(b for b in flat_sizes if b < runner.pool.scratch_token)
        self.width = aligned(max(max_rows, *self.flat_sizes, 1))  # tokens
        # layout columns: the rows, then (at least) one padding column; each table row 16-byte
        # aligned, as an eager step's (model_runner.aligned): the kernels compile one variant
        self.columns = aligned(max_rows + 1)
        self.max_tiles = aligned(max((self._tiles_for(size) for size in self.flat_sizes), default=0))
        device = runner.device
        self._pinned = device.type == "cuda"
        # Static inputs, each family one buffer so a replay writes it with one copy (plain tensors,
        # written between steps, even when these graphs are made on the engine thread).
        with torch.inference_mode(False):
            self._long = torch.zeros(2 * self.width + max_rows, dtype=torch.long, device=device)
            self._int = torch.zeros(7 * self.columns + 2 * self.max_tiles, dtype=torch.int32, device=device)
        self._ids = self._long[:self.width].view(1, -1)
        self._positions = self._long[self.width:2 * self.width].view(1, -1)
        self._last = self._long[2 * self.width:]
        self._table = self._int[:7 * self.columns].view(7, self.columns)  # layout columns, decode rows
        self._tiles = self._int[7 * self.columns:].view(2, self.max_tiles)
        self._decode: dict[int, _Graph] = {}
        self._flat: dict[tuple[int, bool], _Graph] = {}  # (tokens, with decode rows)
        self.replays: Counter[str] = Counter()  # "decode", "chunks", "mixed"
        self.num_failed = 0  # captures that failed: that bucket and every one after it run eagerly, padded
        self.num_bytes = 0  # the graphs' private memory pool, once captured

    # ---- capture -----------------------------------------------------------------------------

    def capture(self) -> None:
        """Capture every bucket, the largest first (its memory pool serves the smaller ones)."""
        started = time.perf_counter()
        device = self.runner.device
        cuda = device.type == "cuda"
        reserved = torch.cuda.memory_reserved(device) if cuda else 0
        self._write_padding()
        pool = None
        for size in reversed(self.flat_sizes):
            for mixed in (False,) if self.invariant else (True, False):
                pool = self._capture_flat(size, mixed, pool)
        for size in reversed(self.decode_sizes):
            layout = self._layout(size, 0)
            step = self.runner.step_inputs([], [1] * size, layout)
            self._decode[size], pool = self._capture(size, step, None, pool, decode=size)
        if cuda:
            torch.cuda.synchronize(device)
            segments = torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            # Else the memory reserved while capturing (it also counts the eager warm passes' cached blocks).
            self.num_bytes = pool_bytes(segments, pool) or max(0, torch.cuda.memory_reserved(device) - reserved)
        log.info("captured %d step graphs (decode batch 1-%d, prompt chunks up to %d tokens%s) in %.1fs, %.0f MiB%s",
                 self.num_captured, self.max_rows, max(self.flat_sizes, default=0),
                 "" if self.invariant else ", alone or beside decode rows", time.perf_counter() - started,
                 self.num_bytes / 2**20,
                 f"; {self.num_graphs - self.num_captured} run eagerly (a capture failed)" if self.num_failed else "")

    def _capture_flat(self, size: int, mixed: bool, pool: Any) -> Any:
        decode = min(size, self.max_rows) if mixed else 0
        sampled = 1 if self.invariant else min(size, self.max_rows)
        step = self.runner.step_inputs([], [size], self._layout(decode, self._tiles_for(size)))
        self._flat[(size, mixed)], pool = self._capture(size, step, self._last[:sampled], pool, decode=decode)
        return pool

    def _capture(self, size: int, step: StepInputs, last: torch.Tensor | None, pool: Any,
                 decode: int) -> tuple[_Graph, Any]:
        args = (self._ids[:, :size], self._positions[:, :size], step, last)
        tiles = step.layout.num_tiles if step.layout is not None else 0
        sampled = last.shape[0] if last is not None else size
        logits = self.runner.run(*args)  # compiles kernels, settles the allocator
        rerun = _Graph(_Rerun(lambda: self.runner.run(*args), logits), logits, decode, tiles, sampled)
        if self.runner.device.type != "cuda" or self.num_failed:
            return rerun, pool
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream(self.runner.device)
        try:
            # thread_local: the disk writer's copies on their own thread and stream are no part of it
            with torch.cuda.graph(graph, pool, capture_error_mode="thread_local"):
                captured = self.runner.run(*args)
        except Exception:
            # A capture that fails to end leaves its stream current, and may leave the allocator
            # mid-capture: the engine's stream is restored, and no further capture is tried.
            torch.cuda.set_stream(stream)
            log.warning("CUDA graph capture failed for a step of %d tokens (%d decode rows); it and every step "
                        "not yet captured run the same padded step eagerly", size, decode, exc_info=True)
            self.num_failed += 1
            return rerun, pool
        return _Graph(graph, captured, decode, tiles, sampled), graph.pool() if pool is None else pool

    @property
    def num_captured(self) -> int:
        """Steps that replay a real CUDA graph (the others, `_Rerun`, run eagerly)."""
        graphs = (*self._decode.values(), *self._flat.values())
        return sum(isinstance(g.replayable, torch.cuda.CUDAGraph) for g in graphs)

    @property
    def num_graphs(self) -> int:
        return len(self._decode) + len(self._flat)

    def _tiles_for(self, size: int) -> int:
        """Prompt tiles a step of `size` tokens can have: its tokens in tiles, plus one partial
        tile per chunk (each at least 2 tokens)."""
        return -(-size // attention.PREFILL_BLOCK_M) + min(size // 2, self.max_rows)

    def _layout(self, decode: int, tiles: int) -> KVLayout:
        t = self._table
        return KVLayout(t[0], t[1], t[2], t[3], t[4], t[5], decode_rows=t[6, :decode],
                        tile_seq=self._tiles[0, :tiles], tile_first=self._tiles[1, :tiles],
                        num_decode=decode, num_tiles=tiles)

    def _write_padding(self) -> None:
        """Every row, tile and token padding (for capture)."""
        self._write([], [], [[] for _ in range(6)], [], [], [])

    # ---- replay ------------------------------------------------------------------------------

    def replay(self, flat: FlatStep, rows: list[RowKV], ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits `[len(rows), vocab]` after the last token of each row, from a graph; None when
        no graph fits the step. `ids`: a decode step's token ids on the device, copied in after
        the host's."""
        total = len(flat.ids)
        if len(rows) > self.max_rows:
            return None
        if total == len(rows):
            size = bucket_of(self.decode_sizes, total)
            graph = self._decode.get(size) if size is not None else None
            kind = "decode"
        elif self.invariant and len(rows) > 1:
            return None
        else:
            size = bucket_of(self.flat_sizes, total)
            mixed = bool(flat.decode)  # a decode row, or a one-token chunk (the decode kernel's, wherever it is)
            graph = self._flat.get((size, mixed)) if size is not None else None
            kind = "mixed" if mixed else "chunks"
        if graph is None or not self._write_step(flat, rows, graph):
            return None
        if ids is not None:
            self._ids[0, :len(rows)].copy_(ids)
        graph.replayable.replay()
        self.replays[kind] += 1
        return graph.logits[:len(rows)]

    def _write_step(self, flat: FlatStep, rows: list[RowKV], graph: _Graph) -> bool:
        """Write the step into the static buffers; False (nothing written) if it does not fit."""
        if len(flat.decode) > graph.decode or len(flat.tiles) > graph.tiles or len(rows) > graph.sampled:
            return False
        self._write(flat.ids, flat.positions, layout_columns(rows, flat.sizes), flat.decode, flat.tiles, flat.last)
        return True

    def _write(self, ids: list[int], positions: list[int], columns: list[list[int]],
               decode: list[int], tiles: list[tuple[int, int]], last: list[int]) -> None:
        """Fill the static buffers: the step's values, then padding to their ends (one copy each)."""
        pad_tokens = self.width - len(ids)
        pad = self.max_rows  # the padding column: no queries (q_len 0), no keys (group and own length 0)
        scratch = self.runner.pool.scratch_token
        longs = [*ids, *[0] * pad_tokens, *positions, *[0] * pad_tokens, *last, *[0] * (self.max_rows - len(last))]
        pad_columns = self.columns - len(columns[0])
        padding = (0, 0, 0, 0, scratch, 0)  # q_start, q_len, group_start, group_len, own_start, own_len
        ints = [value for column, fill in zip(columns, padding, strict=True)
                for value in (*column, *[fill] * pad_columns)]
        ints += [*decode, *[pad] * (self.columns - len(decode))]
        ints += [*(s for s, _ in tiles), *[pad] * (self.max_tiles - len(tiles))]
        ints += [*(f for _, f in tiles), *[0] * (self.max_tiles - len(tiles))]
        self._long.copy_(torch.tensor(longs, dtype=torch.long, pin_memory=self._pinned), non_blocking=True)
        self._int.copy_(torch.tensor(ints, dtype=torch.int32, pin_memory=self._pinned), non_blocking=True)
