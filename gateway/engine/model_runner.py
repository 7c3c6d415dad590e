"""The model runner: one forward pass per engine step over a flat batch.

Every token a step computes (the next token of each decoding sequence, then the prompt chunks)
goes through the model (engine/models/: toolkv's own for the Llama family, transformers' for any
other architecture) as one batch of T tokens with per-token positions. Attention writes the step's
new keys and values into the block pool and reads every sequence's KV in place, in one of two
ways (`backend`, engine/attention.py):
- "triton" (CUDA): kernels over per-sequence metadata (`KVLayout`), and steps of up to 512 tokens
  (decode rows, short prompt chunks, or both) replayed from CUDA graphs captured at start-up per
  bucket (engine/cuda_graphs.py, nano-vllm's scheme grown to chunks);
- "torch" (the CPU, or a GPU without Triton): per sequence, over the pool's strided views.

What the output may depend on (tests/engine/test_batching.py, test_cached_equals_uncached.py):
- never on the cache: a sequence's KV is two segments, its tool group `[0, G)` and its own tokens,
  and prompts are computed in chunks whose boundaries are a function of the token ids (prefix_index.py).
  A hit, a miss and a bypass served alone therefore run the same operations on the same numbers.
- on the batch only when `batch_invariant` is off. A matrix product's rounding depends on how many
  rows it has, so a flat batch rounds a sequence's linears differently from the same sequence
  alone. With `batch_invariant` on (the CPU's default), each linear runs per sequence instead
  (`StepInputs.invariant`, engine/models/layers.py `project`): the decode rows as one
  matrix-vector product each, each prompt chunk as its own product (over as many rows as its CUDA
  graph alone pads it to); attention is per sequence on both backends. Batched == alone then holds
  bitwise, at the cost of one product per sequence.

A step's small host values go to the device without a wait (`staged`): on CUDA a copy from
pageable memory waits for every step queued on the stream (it is staged through a driver buffer
after a sync), so a step built while another is in flight, or a sampler's per-row values, would
stall the host until the device is idle. Pinned memory and a non-blocking copy do not; PyTorch's
pinned allocator keeps the host block until its copy has run.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import nn

from gateway.engine import attention
from gateway.engine.attention import KVLayout
from gateway.engine.stats import MemoryUse
from gateway.kvcache.block_pool import BlockPool, BlockRun

Backend = Literal["torch", "triton"]


@dataclass(slots=True)
class RowKV:
    """Where one sequence of a forward pass reads and writes its KV.

    `group`: per layer, the tool group's keys and values `[kv_heads, G, dim]` (read only), or None;
    `group_start`: the pool token where those keys start (-1: not in the pool, a disk entry used
    from its own tensors; the torch backend only). `own`: the run the new tokens are written to,
    after its first `own_len` tokens. `position`: the absolute position of the first new token
    (= G + own_len)."""

    group: list[tuple[torch.Tensor, torch.Tensor]] | None
    own: BlockRun
    own_len: int
    position: int
    group_start: int = -1
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    @property
    def group_len(self) -> int:
        return self.group[0][0].shape[1] if self.group else 0

    def hidden(self, new_tokens: int, window: int | None, device: torch.device) -> torch.Tensor | None:
        """`[n, all keys]`, True where a query may not see a key (causal inside the chunk, and the
        sliding window); None when every key is visible to every query."""
        if new_tokens == 1 and (window is None or self.position < window):
            return None  # one new token sees every key (the decode step's common case: no tensors)
        if window in self._masks:
            return self._masks[window]
        total = self.group_len + self.own_len + new_tokens
        query_pos = torch.arange(self.position, self.position + new_tokens, device=device)[:, None]
        key_pos = torch.arange(total, device=device)[None, :]
        hidden = key_pos > query_pos
        if window is not None:
            hidden |= query_pos - key_pos >= window
        found = hidden if bool(hidden.any()) else None
        self._masks[window] = found
        return found


@dataclass(slots=True)
class StepInputs:
    """What a model's forward reads besides the token ids and positions: the rows and their token
    counts (decode rows first), the pool, for the Triton backend the KV layout, and how linears
    split the batch (`invariant`: per sequence; `chunk_rows`: the row counts a prompt chunk's
    product is padded up to, its CUDA graph's buckets, so a chunk batched rounds as it does alone)."""

    rows: list[RowKV]
    sizes: list[int]
    pool: BlockPool
    layout: KVLayout | None = None
    invariant: bool = False
    chunk_rows: tuple[int, ...] = ()
    # On the CPU with a thread count that adapts: the row counts whose products round the same on
    # any count (engine/cpu_threads.invariant_rows); a product of other rows is padded up to one.
    thread_rows: tuple[int, ...] = ()

    singles: int = 0  # the leading rows of one token each (decode rows)
    total: int = 0  # tokens in the step

    def __post_init__(self) -> None:  # read by every linear layer of the pass: computed once
        self.total = sum(self.sizes)
        self.singles = next((i for i, size in enumerate(self.sizes) if size != 1), len(self.sizes))


class StepModel(Protocol):
    """A model the runner drives (engine/models/): logits `[S, vocab]` at the flat indices `last`
    (None: every token) of `ids [T]` at `positions [T]`, its attention over `step`."""

    kind: str  # "owned" or "transformers"
    config: Any

    def matrices(self, head: bool) -> list[torch.Tensor] | None:
        """The weights of the products toolkv runs over many rows (`head`: the LM head's too), for
        engine/cpu_threads.invariant_rows; None where it cannot pad them (transformers' fallback)."""
        ...

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, step: StepInputs,
                 last: torch.Tensor | None) -> torch.Tensor: ...


class ModelRunner:
    def __init__(self, model: StepModel, device: torch.device, pool: BlockPool, *, backend: Backend = "torch",
                 batch_invariant: bool = True, weights_bytes: int = 0) -> None:
        self.model = model
        self.device = device
        self.pool = pool
        self.backend: Backend = backend
        self.batch_invariant = batch_invariant
        self.chunk_rows: tuple[int, ...] = ()
        self.thread_rows: tuple[int, ...] = ()  # set with an adaptive thread count (StepInputs)
        self.graphs: Any = None  # engine/cuda_graphs.StepGraphs, once captured (`use_graphs`)
        self.weights_bytes = weights_bytes

    def use_graphs(self, graphs: Any) -> None:
        """Replay steps from `graphs` (a captured engine/cuda_graphs.StepGraphs) from now on."""
        self.graphs = graphs
        # A chunk alone runs its graph's padded row count: so does an eager one, batched.
        self.chunk_rows = graphs.flat_sizes if self.batch_invariant else ()

    def memory(self) -> MemoryUse:
        """What the weights, the KV pool and the captured CUDA graphs take on the device."""
        graphs = self.graphs.num_bytes if self.graphs is not None else 0
        return MemoryUse(self.weights_bytes, self.pool.tensor_bytes, graphs)

    @property
    def reads_pool_only(self) -> bool:
        """Whether every KV a pass reads must be in the pool (the Triton kernels index it)."""
        return self.backend == "triton"

    def forward(self, tokens: list[list[int]], rows: list[RowKV], ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[S, vocab]` after the last token of each row; `tokens[i]` are row i's new tokens
        (rows of one token first, for the batch-invariant split). `ids`: a decode step's token
        ids already on the device (`[S]`, one a row), read in place of `tokens`' values."""
        flat = FlatStep.of(tokens, rows)
        if self.graphs is not None:
            replayed: torch.Tensor | None = self.graphs.replay(flat, rows, ids)
            if replayed is not None:
                return replayed
        step = self.step_inputs(rows, flat.sizes)
        if self.backend == "triton":
            step.layout = build_layout(rows, flat, self.device)
        if ids is not None:
            assert ids.shape == (len(rows),) and len(flat.ids) == len(rows), "device ids: one per decode row"
            ids = ids[None]
        else:
            ids = staged([flat.ids], torch.long, self.device)
        positions = staged([flat.positions], torch.long, self.device)
        last = staged(flat.last, torch.long, self.device)
        return self.run(ids, positions, step, last)

    def step_inputs(self, rows: list[RowKV], sizes: list[int], layout: KVLayout | None = None) -> StepInputs:
        return StepInputs(rows, sizes, self.pool, layout, self.batch_invariant, self.chunk_rows, self.thread_rows)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, step: StepInputs,
            last: torch.Tensor | None) -> torch.Tensor:
        """The model over `ids [1, T]`: logits `[S, vocab]` at `last` (None: every token)."""
        with torch.inference_mode(), _quiet_interpreter(self.backend):
            return self.model(ids[0], positions[0], step, last)


def _quiet_interpreter(backend: Backend) -> contextlib.AbstractContextManager[Any]:
    """Under Triton's interpreter (numpy), no warning for a graph's padding tokens: rows no
    attention kernel writes (never read, as on CUDA), whose leftover values may overflow."""
    if backend != "triton" or not attention.interpreted():
        return contextlib.nullcontext()
    import numpy

    return numpy.errstate(all="ignore")


def tensor_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage once (tied weights share one)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    return sum(storages.values())


@dataclass(frozen=True, slots=True)
class FlatStep:
    """A step's flat batch as host lists, what an eager pass and a graph's static buffers are both
    written from: per token its id and position; per row the index of its last token;
    the rows of one token (the decode kernel's) and the prefill kernel's tiles (row, first query)."""

    sizes: list[int]
    ids: list[int]
    positions: list[int]
    last: list[int]
    decode: list[int]
    tiles: list[tuple[int, int]]

    @classmethod
    def of(cls, tokens: list[list[int]], rows: list[RowKV]) -> FlatStep:
        sizes = [len(t) for t in tokens]
        spans = list(zip(rows, sizes, strict=True))
        ends = list(itertools.accumulate(sizes))
        return cls(sizes, [t for chunk in tokens for t in chunk],
                   [row.position + i for row, size in spans for i in range(size)],
                   [end - 1 for end in ends], [i for i, size in enumerate(sizes) if size == 1],
                   [(i, first) for i, size in enumerate(sizes) if size > 1
                    for first in range(0, size, attention.PREFILL_BLOCK_M)])


def layout_columns(rows: list[RowKV], sizes: list[int]) -> list[list[int]]:
    """Per row: q_start, q_len, group_start, group_len, own_start, own_len (with the new tokens)."""
    columns: list[list[int]] = [[], [], [], [], [], []]
    start = 0
    for row, size in zip(rows, sizes, strict=True):
        assert row.group_len == 0 or row.group_start >= 0, "the Triton kernels read only the pool"
        for column, value in zip(columns, (start, size, max(row.group_start, 0), row.group_len,
                                           row.own.token_start, row.own_len + size), strict=True):
            column.append(value)
        start += size
    return columns


def build_layout(rows: list[RowKV], flat: FlatStep, device: torch.device) -> KVLayout:
    """The kernels' metadata for an eager step."""
    columns = layout_columns(rows, flat.sizes)
    decode = flat.decode + [0] * (len(rows) - len(flat.decode))
    table = staged(aligned_rows([*columns, decode]), torch.int32, device)
    tiles = staged(aligned_rows([[s for s, _ in flat.tiles], [f for _, f in flat.tiles]]), torch.int32, device)
    return KVLayout(table[0], table[1], table[2], table[3], table[4], table[5], decode_rows=table[6],
                    tile_seq=tiles[0], tile_first=tiles[1], num_decode=len(flat.decode), num_tiles=len(flat.tiles))


def aligned(count: int) -> int:
    """`count` int32s rounded up to 16 bytes: a layout row starting there is 16-byte aligned, as
    Triton specializes a pointer argument on (a step whose rows were not would compile its own
    variant of each kernel while serving, ~1 s on a fresh machine, for one row count in four)."""
    return -(-count // 4) * 4


def aligned_rows(rows: list[list[int]]) -> list[list[int]]:
    """Equal-length int32 rows padded to `aligned` length (the padding is never read)."""
    width = aligned(len(rows[0]))
    return [[*row, *[0] * (width - len(row))] for row in rows]


# ---- small host values to the device ---------------------------------------------------------

def staged(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list, or equal-length lists) as a tensor on `device`; on CUDA through pinned
    memory, without waiting for the device."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
