"""The model runner: one forward pass per engine step over a flat batch.

Every token a step computes (the next token of each decoding sequence, then the prompt chunks)
goes through the model's own transformers code as one `[1, T]` batch with per-token positions, so
each linear layer is one matrix product over all T tokens. Attention is the one function toolkv
registers in transformers' `AttentionInterface`; it writes the step's new keys and values into
the block pool and reads every sequence's KV in place, in one of two ways (`backend`):
- "triton" (CUDA): the kernels of engine/attention.py over per-sequence metadata, and steps of up
  to 512 tokens (decode rows, short prompt chunks, or both) replayed from CUDA graphs captured at
  start-up per bucket (engine/cuda_graphs.py, nano-vllm's scheme grown to chunks);
- "torch" (the CPU, or a GPU without Triton): per sequence, over the pool's strided views (a
  decode row: scores per segment, one softmax, `probs @ v` per segment; a prompt chunk: torch's
  fused SDPA over the segments joined into one copy).

What the output may depend on (tests/engine/test_batching.py, test_cached_equals_uncached.py):
- never on the cache: a sequence's KV is two segments, its tool group `[0, G)` and its own tokens,
  and prompts are computed in chunks whose boundaries are a function of the token ids (chunks.py).
  A hit, a miss and a bypass served alone therefore run the same operations on the same numbers.
- on the batch only when `batch_invariant` is off. A matrix product's rounding depends on how many
  rows it has, so a flat batch rounds a sequence's linears differently from the same sequence
  alone. With `batch_invariant` on (the CPU's default), each linear runs per sequence instead: the
  decode rows as one matrix-vector product each (`matmul` with a batch dimension: the kernel one
  row alone runs), each prompt chunk as its own product (over as many rows as its CUDA graph
  alone pads it to); attention is per sequence on both backends. Batched == alone then holds
  bitwise, at the cost of one product per sequence.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from gateway.engine import attention
from gateway.engine.attention import KVLayout
from gateway.engine.staging import staged
from gateway.engine.stats import MemoryUse
from gateway.kvcache.block_pool import BlockPool, BlockRun

ATTENTION_NAME = "toolkv_blocks"
_STEP_KWARG = "toolkv_step"
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
    """What the attention function of one forward reads (passed through transformers' kwargs):
    the rows and their token counts (decode rows first), and for the Triton backend the KV layout
    and the pool slot of every new token."""

    rows: list[RowKV]
    sizes: list[int]
    pool: BlockPool
    layout: KVLayout | None = None
    slots: torch.Tensor | None = None

    singles: int = 0  # the leading rows of one token each (decode rows)
    total: int = 0  # tokens in the step

    def __post_init__(self) -> None:  # read by every linear layer of the pass: computed once
        self.total = sum(self.sizes)
        self.singles = next((i for i, size in enumerate(self.sizes) if size != 1), len(self.sizes))


def paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None,
                    dropout: float = 0.0, sliding_window: int | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: `query [1, Hq, T, D]`, this pass's new `key`/`value`
    `[1, Hk, T, D]`; returns `[1, T, Hq, D]`. Writes the new keys/values into the pool first."""
    step: StepInputs = kwargs[_STEP_KWARG]
    layer: int = module.layer_idx  # type: ignore[assignment]
    dim = query.shape[3]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(dim)
    if step.layout is None:
        return _torch_attention(step, layer, query, key, value, scale, sliding_window), None
    assert step.slots is not None
    keys, values = step.pool.keys[layer], step.pool.values[layer]
    keys.index_copy_(1, step.slots, key[0])
    values.index_copy_(1, step.slots, value[0])
    out = torch.empty((query.shape[2], query.shape[1], dim), dtype=query.dtype, device=query.device)
    attention.attend(query[0].transpose(0, 1), keys, values, step.layout, scale, sliding_window, out)
    return out[None], None


def _torch_attention(step: StepInputs, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float, window: int | None) -> torch.Tensor:
    outputs, offset = [], 0
    for row, new in zip(step.rows, step.sizes, strict=True):
        end = row.own_len + new
        row.own.keys(layer, row.own_len, end).copy_(key[0, :, offset:offset + new])
        row.own.values(layer, row.own_len, end).copy_(value[0, :, offset:offset + new])
        segments = [*(row.group[layer:layer + 1] if row.group else ()),
                    (row.own.keys(layer, 0, end), row.own.values(layer, 0, end))]
        hidden = row.hidden(new, window, query.device)
        q = query[0, :, offset:offset + new]
        out = _attend_in_place(q, segments, hidden, scale) if new == 1 else _attend_chunk(q, segments, hidden, scale)
        outputs.append(out.transpose(0, 1))
        offset += new
    return torch.cat(outputs)[None]


def _attend_in_place(query: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]],
                     hidden: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One token's attention `[Hq, 1, D]` read straight from the segments' strided views: scores
    per segment with grouped-query heads folded (KV heads are never repeated), one softmax over
    them all, `probs @ v` per segment summed in order. Nothing is copied."""
    q_heads, new, dim = query.shape
    kv_heads = segments[0][0].shape[0]
    q = query.reshape(kv_heads, (q_heads // kv_heads) * new, dim)
    scores = torch.cat([torch.matmul(q, k.transpose(1, 2)) for k, _ in segments], dim=-1) * scale
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out, offset = None, 0
    for k, v in segments:
        part = torch.matmul(probs[:, :, offset: offset + k.shape[1]], v)
        out = part if out is None else out + part
        offset += k.shape[1]
    assert out is not None
    return out.view(q_heads, new, dim)


def _attend_chunk(query: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]],
                  hidden: torch.Tensor | None, scale: float) -> torch.Tensor:
    """A prompt chunk's attention `[Hq, n, D]`: torch's fused SDPA over the segments joined into
    one contiguous copy (a chunk's scores are too big to materialize at every layer)."""
    keys = torch.cat([k for k, _ in segments], dim=1)[None]
    values = torch.cat([v for _, v in segments], dim=1)[None]
    mask = None if hidden is None else ~hidden
    out = nn.functional.scaled_dot_product_attention(query[None], keys, values, attn_mask=mask, scale=scale,
                                                     enable_gqa=True)
    return out[0]


class _Split:
    """The per-sequence split of the step running now, for batch-invariant linears; and the row
    counts a prompt chunk's product is padded up to (the graph buckets of a chunk alone, so a chunk
    batched rounds as it does alone)."""

    def __init__(self) -> None:
        self.step: StepInputs | None = None
        self.chunk_rows: tuple[int, ...] = ()


def _invariant_linear(split: _Split, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`F.linear` per sequence of the step: `x [1, T, in]` (every token) or `[1, S, in]` (each
    row's last token, the LM head). Decode rows run as one matrix-vector product each."""
    step = split.step
    if step is None or x.dim() != 3 or x.shape[0] != 1:
        return nn.functional.linear(x, layer.weight, layer.bias)
    if x.shape[1] == step.total:
        singles, chunks = step.singles, step.sizes[step.singles:]
    elif x.shape[1] == len(step.sizes):
        singles, chunks = len(step.sizes), []
    else:
        return nn.functional.linear(x, layer.weight, layer.bias)
    parts = []
    if singles > 1:
        rows = torch.matmul(x[0, :singles, None, :], layer.weight.t().unsqueeze(0))
        parts.append((rows + layer.bias if layer.bias is not None else rows)[:, 0][None])
    elif singles == 1:
        parts.append(nn.functional.linear(x[:, :1], layer.weight, layer.bias))
    offset = singles
    for size in chunks:
        parts.append(_chunk_linear(layer, x[:, offset:offset + size], split.chunk_rows))
        offset += size
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _chunk_linear(layer: nn.Linear, x: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    """One chunk's product, over the rows its graph alone has when that is more than its own (a
    one-token chunk alone is a decode step's single row: never padded)."""
    size = x.shape[1]
    padded = next((r for r in rows if r >= size), size) if size > 1 else size
    if padded == size:
        return nn.functional.linear(x, layer.weight, layer.bias)
    x = nn.functional.pad(x, (0, 0, 0, padded - size))
    return nn.functional.linear(x, layer.weight, layer.bias)[:, :size]


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)


class ModelRunner:
    def __init__(self, model: Any, device: torch.device, pool: BlockPool, *, backend: Backend = "torch",
                 batch_invariant: bool = True) -> None:
        _register()
        self.model = model
        self.device = device
        self.pool = pool
        self.backend: Backend = backend
        self.batch_invariant = batch_invariant
        self._split = _Split()
        self.graphs: Any = None  # engine/cuda_graphs.StepGraphs, once captured (`use_graphs`)
        self.weights_bytes = tensor_bytes(model)
        model.requires_grad_(False)  # autograd bookkeeping changes which kernels run
        model.config._attn_implementation = ATTENTION_NAME
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "_attn_implementation"):
                config._attn_implementation = ATTENTION_NAME
            if batch_invariant and type(module) is nn.Linear:  # bitsandbytes' 4-bit layers keep their own
                module.forward = _bind(self._split, module)  # type: ignore[method-assign]

    def use_graphs(self, graphs: Any) -> None:
        """Replay steps from `graphs` (a captured engine/cuda_graphs.StepGraphs) from now on."""
        self.graphs = graphs
        # A chunk alone runs its graph's padded row count: so does an eager one, batched.
        self._split.chunk_rows = graphs.flat_sizes if self.batch_invariant else ()

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
        step = self._inputs(rows, flat)
        if ids is not None:
            assert ids.shape == (len(rows),) and len(flat.ids) == len(rows), "device ids: one per decode row"
            ids = ids[None]
        else:
            ids = staged([flat.ids], torch.long, self.device)
        positions = staged([flat.positions], torch.long, self.device)
        last = staged(flat.last, torch.long, self.device)
        return self.run(ids, positions, step, last)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, step: StepInputs,
            last: torch.Tensor | None) -> torch.Tensor:
        """The model over `ids [1, T]`: logits `[S, vocab]` at `last` (None: every token)."""
        self._split.step = step
        try:
            with torch.inference_mode():
                out = self.model(input_ids=ids, position_ids=positions, use_cache=False,
                                 logits_to_keep=last if last is not None else 0, **{_STEP_KWARG: step})
        finally:
            self._split.step = None
        logits: torch.Tensor = out.logits[0]
        return logits

    def _inputs(self, rows: list[RowKV], flat: FlatStep) -> StepInputs:
        step = StepInputs(rows, flat.sizes, self.pool)
        if self.backend == "triton":
            step.layout, step.slots = build_layout(rows, flat, self.device)
        return step


def tensor_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage once (tied weights share one)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    return sum(storages.values())


def _bind(split: _Split, layer: nn.Linear) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _invariant_linear(split, layer, x)
    return forward


@dataclass(frozen=True, slots=True)
class FlatStep:
    """A step's flat batch as host lists, what an eager pass and a graph's static buffers are both
    written from: per token its id, position and pool slot; per row the index of its last token;
    the rows of one token (the decode kernel's) and the prefill kernel's tiles (row, first query)."""

    sizes: list[int]
    ids: list[int]
    positions: list[int]
    slots: list[int]
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
                   [row.own.token_start + row.own_len + i for row, size in spans for i in range(size)],
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


def build_layout(rows: list[RowKV], flat: FlatStep, device: torch.device) -> tuple[KVLayout, torch.Tensor]:
    """The kernels' metadata for an eager step, and each new token's pool slot."""
    columns = layout_columns(rows, flat.sizes)
    decode = flat.decode + [0] * (len(rows) - len(flat.decode))
    table = staged(aligned_rows([*columns, decode]), torch.int32, device)
    tiles = staged(aligned_rows([[s for s, _ in flat.tiles], [f for _, f in flat.tiles]]), torch.int32, device)
    slots = staged(flat.slots, torch.long, device)
    layout = KVLayout(table[0], table[1], table[2], table[3], table[4], table[5], decode_rows=table[6],
                      tile_seq=tiles[0], tile_first=tiles[1],
                      num_decode=len(flat.decode), num_tiles=len(flat.tiles))
    return layout, slots


def aligned(count: int) -> int:
    """`count` int32s rounded up to 16 bytes: a layout row starting there is 16-byte aligned, as
    Triton specializes a pointer argument on (a step whose rows were not would compile its own
    variant of each kernel while serving, ~1 s on a fresh machine, for one row count in four)."""
    return -(-count // 4) * 4


def aligned_rows(rows: list[list[int]]) -> list[list[int]]:
    """Equal-length int32 rows padded to `aligned` length (the padding is never read)."""
    width = aligned(len(rows[0]))
    return [[*row, *[0] * (width - len(row))] for row in rows]
