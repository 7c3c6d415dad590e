"""Paged attention over the block pool for a flat batch, on two backends: Triton kernels that read
every sequence's KV where it lives (CUDA), and torch per sequence (the CPU).

A sequence's keys are two segments of the pool's token axis (kvcache/block_pool.py): its tool group
`[0, G)` at pool token `group_start`, then its own tokens `[G, G + own_len)` at `own_start` (the
tokens of this step included). Key position `p` lives at `group_start + p` when `p < G`, else at
`own_start + p - G`. The pool's layout per layer is `[kv_heads, tokens, head_dim]`, so a head's
keys are one strided run.

Triton (`attend`), over the layer's fused projection `qkv [T, (q_heads + 2 kv_heads) * D]`:
- `decode`: sequences with one new token (decode steps), one launch: each program turns its
  query heads and its KV head's new key (q/k norm, RoPE), writes the new key and value to the pool,
  and attends over one split of the keys ("flash decoding": grid `(rows, kv_heads, NUM_SPLITS)`,
  grouped-query heads folded into the matrix rows so each key is read once); the last split to
  finish combines the splits in a fixed order. The split length is a function of the sequence's
  own KV length alone: a row's result never depends on the other rows (batch invariance), and the
  launch shape depends only on the number of rows (CUDA-graph capture).
- prompt chunks: `rope_kv` turns their queries in place and writes their keys and values, then
  `prefill`, flash attention over `BLOCK_M` query tokens a program, causal from the chunk's own
  position, grid `(tiles, q_heads)`.
Both apply an optional sliding window. On a machine without a GPU the tests run them through
Triton's interpreter (tests/engine/test_attention_kernels.py checks them against plain attention).

Torch (`torch_attention`), per sequence over the pool's strided views, after the caller turned
and wrote the step's keys: a decode row or a chunk of up to `SMALL_CHUNK_TOKENS` (a hit's few new
tokens) as scores per segment, one softmax, `probs @ v` per segment; a longer prompt chunk as
torch's fused SDPA over the segments joined into one copy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # the runner builds the rows; only their type is needed here
    from gateway.engine.model_runner import RowKV

NUM_SPLITS = 16  # key splits per decode row (enough programs to fill an H100 at batch 1)
DECODE_BLOCK_N = 64
PREFILL_BLOCK_M = 32
PREFILL_BLOCK_N = 64
# The torch backend attends a chunk of up to this many new tokens with explicit products read in
# place, not SDPA: nothing is copied, and on the CPU SDPA's kernel splits a 1- or 3-token chunk's
# work by the thread count (its last bits change with it; engine/cpu_threads.py), these products do not.
SMALL_CHUNK_TOKENS = 16


def available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on `device`: CUDA with Triton installed, or the CPU
    under Triton's interpreter (`TRITON_INTERPRET=1`: the test suite on a machine without a GPU)."""
    if device.type != "cuda" and not interpreted():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(slots=True)
class KVLayout:
    """Per sequence of the flat batch (int32 tensors on the device, `[S]`), where its queries and
    keys are: `q_start`/`q_len` in the flat batch, and its two key segments. A sequence with no
    queries and no keys (a CUDA graph's padding) reads nothing and writes nothing."""

    q_start: torch.Tensor
    q_len: torch.Tensor
    group_start: torch.Tensor
    group_len: torch.Tensor
    own_start: torch.Tensor
    own_len: torch.Tensor  # own keys including this step's new tokens
    decode_rows: torch.Tensor  # indices (into the S sequences) of the one-token sequences
    tile_seq: torch.Tensor  # prefill tiles: which sequence, and the first query (chunk-relative)
    tile_first: torch.Tensor
    num_decode: int
    num_tiles: int


@dataclass(frozen=True, slots=True)
class HeadShape:
    """What attention knows of a layer: its heads, scale and window, and how q and k are turned
    (`norm [2, D]`: Qwen3's q and k norm weights, or None; RoPE's inverse frequencies `[D / 2]`,
    float32, and the scale on its tables)."""

    q_heads: int
    kv_heads: int
    dim: int
    scale: float
    window: int | None
    inv_freq: torch.Tensor
    rope_scale: float = 1.0
    norm: torch.Tensor | None = None
    eps: float = 1e-6


class DecodeScratch:
    """The decode kernel's split partials and per-(row, KV head) counts, one set a step shared by
    its layers (each layer's launch leaves the counts at zero)."""

    def __init__(self, rows: int, shape: HeadShape, device: torch.device) -> None:
        self.part = torch.empty((rows, shape.q_heads, NUM_SPLITS, shape.dim), dtype=torch.float32, device=device)
        self.lse = torch.empty((rows, shape.q_heads, NUM_SPLITS), dtype=torch.float32, device=device)
        self.count = torch.zeros((rows, shape.kv_heads), dtype=torch.int32, device=device)


def attend(qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: KVLayout, shape: HeadShape,
           scratch: DecodeScratch | None, out: torch.Tensor) -> None:
    """`qkv [T, (q_heads + 2 kv_heads) * D]` (rows contiguous: the projection's raw output; the
    prompt chunks' queries are turned in place); `keys`/`values` one layer of the pool
    `[kv_heads, N, D]`; writes the new keys and values there and `out [T, q_heads, D]`."""
    k = _kernels()
    q_heads, kv_heads, dim = shape.q_heads, shape.kv_heads, shape.dim
    group = q_heads // kv_heads
    block_d = max(16, 1 << (dim - 1).bit_length())
    win = shape.window or 0
    precision = "ieee" if qkv.dtype == torch.float32 else "tf32"  # fp32 models: no TF32 rounding
    f32_dot = interpreted() and qkv.dtype == torch.bfloat16
    norm = shape.norm if shape.norm is not None else shape.inv_freq  # never read without a norm
    if layout.num_tiles:
        k.rope_kv[(layout.num_tiles, q_heads + kv_heads)](
            qkv, keys, values, norm, shape.inv_freq, layout.tile_seq, layout.tile_first, layout.q_start,
            layout.q_len, layout.group_len, layout.own_start, layout.own_len, shape.rope_scale, shape.eps,
            qkv.stride(0), keys.stride(0), keys.stride(1), Q_HEADS=q_heads, KV_HEADS=kv_heads, DIM=dim,
            BLOCK_D=block_d, BLOCK_M=PREFILL_BLOCK_M, HAS_NORM=shape.norm is not None)
        k.prefill[(layout.num_tiles, q_heads)](
            qkv, keys, values, out, layout.tile_seq, layout.tile_first, layout.q_start, layout.q_len,
            layout.group_start, layout.group_len, layout.own_start, layout.own_len, shape.scale, win,
            qkv.stride(0), dim, keys.stride(0), keys.stride(1), out.stride(0), out.stride(1),
            GROUP=group, DIM=dim, BLOCK_D=block_d, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N,
            PRECISION=precision, F32_DOT=f32_dot)
    if layout.num_decode:
        assert scratch is not None and scratch.count.shape[0] >= layout.num_decode, "decode rows need scratch"
        k.decode[(layout.num_decode, kv_heads, NUM_SPLITS)](
            qkv, keys, values, out, scratch.part, scratch.lse, scratch.count, norm, shape.inv_freq,
            layout.decode_rows, layout.q_start, layout.q_len, layout.group_start, layout.group_len,
            layout.own_start, layout.own_len, shape.rope_scale, shape.eps, shape.scale, win,
            qkv.stride(0), keys.stride(0), keys.stride(1), out.stride(0), out.stride(1),
            Q_HEADS=q_heads, GROUP=group, GROUP_PAD=max(16, 1 << group.bit_length()), DIM=dim,
            BLOCK_D=block_d, BLOCK_N=DECODE_BLOCK_N, SPLITS=NUM_SPLITS, PRECISION=precision,
            HAS_NORM=shape.norm is not None, F32_DOT=f32_dot)


def _kernels() -> Any:
    from gateway.engine import triton_kernels  # lazy: Triton is optional (not installed with the CPU wheel)

    return triton_kernels


def torch_attention(rows: list[RowKV], sizes: list[int], layer: int, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """`query [T, q_heads, D]`, the step's turned `key`/`value` `[T, kv_heads, D]`: written to
    each row's own run, then attended per row. Returns `[T, q_heads, D]`."""
    outputs, offset = [], 0
    for row, new in zip(rows, sizes, strict=True):
        end = row.own_len + new
        row.own.keys(layer, row.own_len, end).copy_(key[offset:offset + new].transpose(0, 1))
        row.own.values(layer, row.own_len, end).copy_(value[offset:offset + new].transpose(0, 1))
        segments = [*(row.group[layer:layer + 1] if row.group else ()),
                    (row.own.keys(layer, 0, end), row.own.values(layer, 0, end))]
        hidden = row.hidden(new, window, query.device)
        q = query[offset:offset + new].transpose(0, 1)
        small = new <= SMALL_CHUNK_TOKENS
        out = _attend_in_place(q, segments, hidden, scale) if small else _attend_chunk(q, segments, hidden, scale)
        outputs.append(out.transpose(0, 1))
        offset += new
    return torch.cat(outputs)


def _attend_in_place(query: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]],
                     hidden: torch.Tensor | None, scale: float) -> torch.Tensor:
    """A decode token's or a short chunk's attention `[Hq, n, D]` read straight from the segments'
    strided views: scores per segment with grouped-query heads folded (KV heads are never
    repeated), one softmax over them all, `probs @ v` per segment summed in order. Nothing is
    copied (a hit's few new tokens over a cached group read the group in place)."""
    q_heads, new, dim = query.shape
    kv_heads = segments[0][0].shape[0]
    q = query.reshape(kv_heads, (q_heads // kv_heads) * new, dim)  # rows: (head in group, token)
    scores = torch.cat([torch.matmul(q, k.transpose(1, 2)) for k, _ in segments], dim=-1) * scale
    if hidden is not None:
        scores = scores.masked_fill(hidden.repeat(q_heads // kv_heads, 1) if new > 1 else hidden, float("-inf"))
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
