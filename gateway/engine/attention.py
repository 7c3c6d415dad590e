"""Paged attention over the block pool, for a flat batch: Triton kernels that read every
sequence's KV where it lives, with no copy and no Python loop per sequence.

A sequence's keys are two segments of the pool's token axis (kvcache/block_pool.py): its tool group
`[0, G)` at pool token `group_start`, then its own tokens `[G, G + own_len)` at `own_start` (the
tokens of this step included: their KV is written before the kernels run). Key position `p` lives
at `group_start + p` when `p < G`, else at `own_start + p - G`. The pool's layout per layer is
`[kv_heads, tokens, head_dim]`, so a head's keys are one strided run.

Two kernels share one output `[T, q_heads, head_dim]`:
- `_decode`: sequences with one new token (decode steps), split-KV ("flash decoding"): grid
  `(rows, kv_heads, NUM_SPLITS)`; a program holds the query heads of one KV head (grouped-query
  heads folded into the matrix rows, so each key is read once) and one split of the keys. The split
  length is a function of the sequence's own KV length alone, and a second kernel combines the
  splits in a fixed order: a row's result never depends on the other rows (batch invariance), and
  the launch shape depends only on the number of rows (CUDA-graph capture).
- `_prefill`: prompt chunks, flash attention over `BLOCK_M` query tokens a program, causal from
  the chunk's own position, grid `(tiles, q_heads)`.
Both apply an optional sliding window. On a machine without a GPU the tests run them through
Triton's interpreter (tests/engine/test_attention_kernels.py checks them against plain attention).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

NUM_SPLITS = 16  # key splits per decode row (enough programs to fill an H100 at batch 1)
DECODE_BLOCK_N = 64
PREFILL_BLOCK_M = 32
PREFILL_BLOCK_N = 64


def available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on `device`: CUDA with Triton installed, or the CPU
    under Triton's interpreter (`TRITON_INTERPRET=1`: the test suite on a machine without a GPU)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(slots=True)
class KVLayout:
    """Per sequence of the flat batch (int32 tensors on the device, `[S]`), where its queries and
    keys are: `q_start`/`q_len` in the flat batch, and its two key segments. A sequence with no
    queries and no keys (a CUDA graph's padding) reads nothing and writes no output."""

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


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: KVLayout, scale: float,
           window: int | None, out: torch.Tensor) -> None:
    """`query [T, q_heads, D]` (any strides, last dim contiguous); `keys`/`values` one layer of
    the pool `[kv_heads, N, D]`; writes `out [T, q_heads, D]`."""
    k = _kernels()
    q_heads, dim = query.shape[1], query.shape[2]
    kv_heads = keys.shape[0]
    group = q_heads // kv_heads
    block_d = max(16, 1 << (dim - 1).bit_length())
    win = window or 0
    precision = "ieee" if query.dtype == torch.float32 else "tf32"  # fp32 models: no TF32 rounding
    if layout.num_decode:
        rows = layout.num_decode
        part = torch.empty((rows, q_heads, NUM_SPLITS, dim), dtype=torch.float32, device=query.device)
        lse = torch.empty((rows, q_heads, NUM_SPLITS), dtype=torch.float32, device=query.device)
        k.decode[(rows, kv_heads, NUM_SPLITS)](
            query, keys, values, part, lse, layout.decode_rows, layout.q_start, layout.group_start,
            layout.group_len, layout.own_start, layout.own_len, scale, win,
            query.stride(0), query.stride(1), keys.stride(0), keys.stride(1),
            GROUP=group, GROUP_PAD=max(16, 1 << (group - 1).bit_length()), DIM=dim, BLOCK_D=block_d,
            BLOCK_N=DECODE_BLOCK_N, SPLITS=NUM_SPLITS, PRECISION=precision)
        k.combine[(rows, q_heads)](part, lse, out, layout.decode_rows, layout.q_start, layout.q_len,
                                   out.stride(0), out.stride(1),
                                   DIM=dim, BLOCK_D=block_d, SPLITS=NUM_SPLITS)
    if layout.num_tiles:
        k.prefill[(layout.num_tiles, q_heads)](
            query, keys, values, out, layout.tile_seq, layout.tile_first, layout.q_start, layout.q_len,
            layout.group_start, layout.group_len, layout.own_start, layout.own_len, scale, win,
            query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), out.stride(0), out.stride(1),
            GROUP=group, DIM=dim, BLOCK_D=block_d, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N,
            PRECISION=precision)


def _kernels() -> Any:
    from gateway.engine import triton_kernels  # lazy: Triton is optional (not installed with the CPU wheel)

    return triton_kernels
