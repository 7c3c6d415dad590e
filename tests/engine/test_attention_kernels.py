"""The Triton attention kernels (engine/attention.py) against plain attention, and the engine on
them: a hit, a miss and a bypass give the same tokens; with `batch_invariant`, so does batching.
On a machine without a GPU the kernels run under Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from gateway.engine.attention import PREFILL_BLOCK_M, KVLayout, attend
from tests.engine.conftest import generate
from tests.engine.test_batching import body, run_together

pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (group start, group length, own start, own tokens before this step, new tokens)
SEQUENCES = [(0, 40, 100, 0, 1), (0, 40, 200, 17, 1), (300, 0, 350, 5, 37), (0, 40, 420, 3, 70), (0, 0, 500, 0, 1)]


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


def _reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
               window: int | None) -> torch.Tensor:
    out, start = torch.zeros_like(query), 0
    group = query.shape[1] // keys.shape[0]
    for g0, g, o0, before, new in SEQUENCES:
        k = torch.cat([keys[:, g0:g0 + g], keys[:, o0:o0 + before + new]], 1).repeat_interleave(group, 0)
        v = torch.cat([values[:, g0:g0 + g], values[:, o0:o0 + before + new]], 1).repeat_interleave(group, 0)
        q = query[start:start + new].transpose(0, 1)
        scores = q @ k.transpose(1, 2) * scale
        q_pos = torch.arange(g + before, g + before + new, device=DEVICE)[:, None]
        k_pos = torch.arange(g + before + new, device=DEVICE)[None]
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= q_pos - k_pos >= window
        out[start:start + new] = (scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v).transpose(0, 1)
        start += new
    return out


@pytest.mark.parametrize("window", [None, 20])
def test_kernels_equal_plain_attention_over_two_segments(window):
    """Decode rows and prompt chunks of several sequences at once, each reading its tool group's
    keys and its own from two places in the pool, grouped-query heads, an optional window."""
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(2, 640, 16, generator=generator).to(DEVICE) for _ in range(2))
    tokens = sum(s[4] for s in SEQUENCES)
    query = torch.randn(tokens, 6, 16, generator=generator).to(DEVICE)
    out = torch.full_like(query, float("nan"))
    attend(query, keys, values, _layout(), 0.25, window, out)
    torch.testing.assert_close(out, _reference(query, keys, values, 0.25, window), atol=1e-4, rtol=1e-4)


def test_on_the_kernels_a_hit_a_miss_and_a_bypass_give_the_same_tokens(runtime_for, merchant_tools):
    runtime = runtime_for("llama", attention_backend="triton", batch_invariant=False)
    assert runtime.engine.runner.backend == "triton"
    request = body(merchant_tools[:2], "Refunds?", max_tokens=6)
    miss, hit = generate(runtime, request), generate(runtime, request)
    bypass = generate(runtime, request, bypass=True)
    assert (miss.prefilled.result, hit.prefilled.result) == ("miss", "hit")
    assert hit.prefilled.cached_tokens > 0
    assert miss.finished.token_ids == hit.finished.token_ids == bypass.finished.token_ids


def test_on_the_kernels_batch_invariant_requests_batched_give_their_tokens_alone(runtime_for, merchant_tools):
    runtime = runtime_for("qwen2", attention_backend="triton", batch_invariant=True)
    requests = [body(merchant_tools[:2], q, max_tokens=5) for q in ("hi", "Top sellers?", "Stock of item 7?")]
    alone = [generate(runtime, r).finished.token_ids for r in requests]
    together = run_together(runtime, [(r, False) for r in requests])
    assert [run.finished.token_ids for run in together] == alone


def test_every_layout_row_the_kernels_read_starts_16_byte_aligned(runtime_for):
    """Triton compiles a kernel variant per pattern of 16-byte-aligned pointer arguments: the
    layout's rows must be aligned whatever the step's row and tile counts (eager) and in the
    graphs' static table, or a step of an unseen count compiles while serving (~1 s a variant)."""
    from gateway.engine.cuda_graphs import StepGraphs
    from gateway.engine.model_runner import FlatStep, RowKV, build_layout

    runner = runtime_for("llama", attention_backend="triton", max_batch=5).engine.runner
    graphs = StepGraphs(runner, 5, (16, 32))
    tables = [graphs._layout(5, graphs._tiles_for(32))]
    runs = [runner.pool.allocate(80) for _ in range(6)]
    for count in range(1, 7):
        for chunk in (1, 3, 40):  # decode rows only, then one chunk of a tile, then of two
            tokens = [[1]] * (count - 1) + [[1] * chunk]
            rows = [RowKV(None, run, 0, 0) for run in runs[:count]]
            tables.append(build_layout(rows, FlatStep.of(tokens, rows), runner.device)[0])
    for layout in tables:
        pointers = [getattr(layout, name).data_ptr() for name in
                    ("q_start", "q_len", "group_start", "group_len", "own_start", "own_len", "decode_rows",
                     "tile_seq", "tile_first")]
        assert all(pointer % 16 == 0 for pointer in pointers)
    for run in runs:
        run.release()
