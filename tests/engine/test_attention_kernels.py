"""The Triton attention kernels (engine/attention.py) against plain attention, and the engine on
them: a hit, a miss and a bypass give the same tokens; with `batch_invariant`, so does batching.
On a machine without a GPU the kernels run under Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from gateway.engine.attention import PREFILL_BLOCK_M, DecodeScratch, HeadShape, KVLayout, attend
from tests.engine.conftest import generate
from tests.engine.test_batching import body
from tests.engine.test_step_graphs import TOOL

pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (group start, group length, own start, own tokens before this step, new tokens): decode rows and
# prompt chunks, lengths that are multiples of no block (16), tile (32) or key block (64)
SEQUENCES = [(0, 40, 100, 0, 1), (0, 40, 200, 17, 1), (300, 0, 350, 5, 37), (0, 40, 420, 3, 70), (0, 0, 500, 0, 1)]
TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _int(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _layout() -> KVLayout:
    q_start, start = [], 0
    for *_, new in SEQUENCES:
        q_start.append(start)
        start += new
    decode = [i for i, s in enumerate(SEQUENCES) if s[4] == 1]
    tiles = [(i, f) for i, s in enumerate(SEQUENCES) if s[4] > 1 for f in range(0, s[4], PREFILL_BLOCK_M)]
    return KVLayout(_int(q_start), _int([s[4] for s in SEQUENCES]), _int([s[0] for s in SEQUENCES]),
                    _int([s[1] for s in SEQUENCES]), _int([s[2] for s in SEQUENCES]),
                    _int([s[3] + s[4] for s in SEQUENCES]), _int(decode), _int([t[0] for t in tiles]),
                    _int([t[1] for t in tiles]), len(decode), len(tiles))


def _turned(x: torch.Tensor, positions: torch.Tensor, shape: HeadShape, norm: torch.Tensor | None) -> torch.Tensor:
    """`x [T, heads, D]` in float64: q/k norm, then RoPE (the exact tables, no rounding)."""
    if norm is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + shape.eps) * norm.double()
    freqs = positions[:, None].double() * shape.inv_freq.double()[None]
    angles = torch.cat((freqs, freqs), -1)[:, None]
    half = x.shape[-1] // 2
    return x * angles.cos() + torch.cat((-x[..., half:], x[..., :half]), -1) * angles.sin()


def _reference(qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               shape: HeadShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention in float64 over the pool with the step's turned keys written; and the pool."""
    heads = qkv.double().view(qkv.shape[0], -1, shape.dim)
    q, k, v = heads.split([shape.q_heads, shape.kv_heads, shape.kv_heads], dim=1)
    positions = torch.cat([torch.arange(g + before, g + before + new) for _, g, _, before, new in SEQUENCES])
    norms = shape.norm if shape.norm is not None else (None, None)
    q, k = _turned(q, positions, shape, norms[0]), _turned(k, positions, shape, norms[1])
    keys, values = keys.double().clone(), values.double().clone()
    out, start = torch.zeros_like(q), 0
    group = shape.q_heads // shape.kv_heads
    for g0, g, o0, before, new in SEQUENCES:
        keys[:, o0 + before:o0 + before + new] = k[start:start + new].transpose(0, 1)
        values[:, o0 + before:o0 + before + new] = v[start:start + new].transpose(0, 1)
        seq_k = torch.cat([keys[:, g0:g0 + g], keys[:, o0:o0 + before + new]], 1).repeat_interleave(group, 0)
        seq_v = torch.cat([values[:, g0:g0 + g], values[:, o0:o0 + before + new]], 1).repeat_interleave(group, 0)
        scores = q[start:start + new].transpose(0, 1) @ seq_k.transpose(1, 2) * shape.scale
        q_pos = torch.arange(g + before, g + before + new)[:, None]
        k_pos = torch.arange(g + before + new)[None]
        hidden = k_pos > q_pos
        if shape.window is not None:
            hidden |= q_pos - k_pos >= shape.window
        out[start:start + new] = (scores.masked_fill(hidden, float("-inf")).softmax(-1) @ seq_v).transpose(0, 1)
        start += new
    return out, keys, values


CASES = [  # dtype, q heads, kv heads (grouped-query ratios 1, 4, 7, 8), head dim, q/k norm, window
    (torch.float32, 8, 2, 64, True, None),
    (torch.bfloat16, 7, 1, 128, False, None),
    (torch.float16, 8, 1, 256, True, None),
    (torch.bfloat16, 2, 2, 64, False, 20),
    (torch.float16, 4, 1, 128, False, 20),
]


@pytest.mark.parametrize(("dtype", "q_heads", "kv_heads", "dim", "norm", "window"), CASES)
def test_kernels_turn_write_and_attend_as_plain_attention(dtype, q_heads, kv_heads, dim, norm, window):
    """Decode rows and prompt chunks of several sequences at once, from the layer's fused
    projection: the new queries and keys normed (Qwen3) and rotated, the new keys and values
    written to each sequence's own run, attention over its tool group's keys and its own read from
    two places in the pool; against float64 attention, in each dtype."""
    generator = torch.Generator().manual_seed(dim + q_heads)
    tokens = sum(s[4] for s in SEQUENCES)
    keys, values = (torch.randn(kv_heads, 640, dim, generator=generator).to(DEVICE, dtype) for _ in range(2))
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=generator).to(DEVICE, dtype)
    weights = (1 + 0.2 * torch.randn(2, dim, generator=generator)).to(DEVICE, dtype) if norm else None
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=DEVICE) / dim))
    shape = HeadShape(q_heads, kv_heads, dim, dim ** -0.5, window, inv_freq, 1.0, weights, 1e-6)
    expected, expected_keys, expected_values = _reference(qkv, keys, values, shape)
    out = torch.full((tokens, q_heads, dim), float("nan"), dtype=dtype, device=DEVICE)
    attend(qkv, keys, values, _layout(), shape, DecodeScratch(3, shape, DEVICE), out)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(keys.double(), expected_keys, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(values.double(), expected_values, atol=0, rtol=0)


def test_on_the_kernels_a_hit_a_miss_and_a_bypass_give_the_same_tokens(runtime_for):
    """The engine on the kernels, eagerly (no step graphs). With `batch_invariant`, batched still
    equals alone on them: tests/engine/test_step_graphs.py, whose batched steps run eagerly."""
    runtime = runtime_for("llama", attention_backend="triton", batch_invariant=False)
    assert runtime.engine.runner.backend == "triton"
    request = body(TOOL, "Refunds?", max_tokens=3)
    miss, hit = generate(runtime, request), generate(runtime, request)
    bypass = generate(runtime, request, bypass=True)
    assert (miss.prefilled.result, hit.prefilled.result) == ("miss", "hit")
    assert hit.prefilled.cached_tokens > 0
    assert miss.finished.token_ids == hit.finished.token_ids == bypass.finished.token_ids


def test_every_layout_row_the_kernels_read_starts_16_byte_aligned(runtime_for):
    """Triton compiles a kernel variant per pattern of 16-byte-aligned pointer arguments: the
    layout's rows must be aligned whatever the step's row and tile counts (eager) and in the
    graphs' static table, or a step of an unseen count compiles while serving (~1 s a variant)."""
    from gateway.engine.cuda_graphs import StepGraphs
    from gateway.engine.model_runner import FlatStep, RowKV, build_layout

    engine = runtime_for("llama", attention_backend="triton", max_batch=5).engine
    runner = engine.runner

    def layouts() -> list[KVLayout]:  # on the engine's thread: the pool is its own (kvcache/block_pool.py's `Owner`)
        graphs = StepGraphs(runner, 5, (16, 32))
        tables = [graphs._layout(5, graphs._tiles_for(32))]
        runs = [runner.pool.allocate(80) for _ in range(6)]
        try:
            for count in range(1, 7):
                for chunk in (1, 3, 40):  # decode rows only, then one chunk of a tile, then of two
                    tokens = [[1]] * (count - 1) + [[1] * chunk]
                    rows = [RowKV(None, run, 0, 0) for run in runs[:count] if run is not None]
                    tables.append(build_layout(rows, FlatStep.of(tokens, rows), runner.device))
        finally:
            for run in runs:
                if run is not None:
                    run.release()
        return tables

    for layout in engine.call(layouts).result():
        pointers = [getattr(layout, name).data_ptr() for name in
                    ("q_start", "q_len", "group_start", "group_len", "own_start", "own_len", "decode_rows",
                     "tile_seq", "tile_first")]
        assert all(pointer % 16 == 0 for pointer in pointers)
