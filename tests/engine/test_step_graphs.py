"""Steps replayed from captured graphs (engine/cuda_graphs.py): decode steps, prompt chunks alone,
and decode rows beside prompt chunks give the tokens the eager engine gives, a hit, a miss and a
bypass still agree, and with `batch_invariant` batched still equals alone. On a machine without a
GPU a graph re-runs its step on the same static buffers (through Triton's interpreter), so the
buffers, padding and layouts are what is checked here; on CUDA the graphs are real."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from gateway.engine import Finished, Prefilled
from gateway.engine.cuda_graphs import StepGraphs, flat_buckets
from gateway.engine.model_runner import RowKV
from gateway.engine.plan import engine_plan
from gateway.protocol.chat import ChatCompletionRequest
from gateway.serving.runtime import Runtime
from gateway.settings import load_settings
from tests.engine.conftest import generate, make_runtime
from tests.engine.test_batching import QUESTIONS, body, run_together

pytest.importorskip("triton")
T = TypeVar("T")
SIZES = (16, 32)  # small buckets and batches: the interpreter runs every padding row and tile
SMALL = {"attention_backend": "triton", "max_batch": 4}
# One short tool (~190 prompt tokens): the interpreter's cost grows with the prompt's tiles and key
# blocks; several of each are all these checks need (the kernels' layouts: test_attention_kernels.py).
TOOL = [{"type": "function", "function": {
    "name": "order_timeline", "description": "Get detailed timeline of an order from placement to delivery",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string", "description": "Order ID"}},
                   "required": ["order_id"]}}}]


def use_graphs(runtime: Runtime) -> StepGraphs:
    engine = runtime.engine

    def capture() -> StepGraphs:
        graphs = StepGraphs(engine.runner, engine.max_batch, SIZES)
        graphs.capture()
        engine.runner.use_graphs(graphs)
        return graphs

    return engine.call(capture).result()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def window_on_graphs(tiny_model_dir: Callable[..., Path]) -> Iterator[tuple[Runtime, StepGraphs]]:
    """An engine on the kernels with its graphs captured, shared by the module's tests that are not
    batch-invariant (a capture re-runs every bucket's step through the interpreter); each test counts
    its replays. A model with a sliding window, so the window reaches the kernels too; 16-token
    prompt chunks, so a prompt is several chunks (each replayed, alone or beside decode rows)."""
    runtime = make_runtime(tiny_model_dir("mistral-window"), batch_invariant=False, prefill_chunk_tokens=16,
                           **SMALL)
    try:
        yield runtime, use_graphs(runtime)
    finally:
        runtime.engine.stop()


def eagerly(runtime: Runtime, graphs: StepGraphs, run: Callable[[], T]) -> T:
    """`run()` with the runner's graphs set aside (on the engine's thread, between steps)."""
    runner = runtime.engine.runner
    runtime.engine.call(lambda: setattr(runner, "graphs", None)).result()
    try:
        return run()
    finally:
        runtime.engine.call(lambda: setattr(runner, "graphs", graphs)).result()


def test_on_graphs_a_hit_a_miss_and_a_bypass_give_the_eager_engines_tokens(window_on_graphs):
    runtime, graphs = window_on_graphs
    request = body(TOOL, "Refunds?", max_tokens=3)
    eager = eagerly(runtime, graphs, lambda: generate(runtime, request, bypass=True))
    before = graphs.replays.copy()
    # the tenant's salt: its group is its own, a miss whichever of the module's tests ran before
    miss, hit = generate(runtime, request, tenant="t1"), generate(runtime, request, tenant="t1")
    bypass = generate(runtime, request, bypass=True)
    assert (miss.prefilled.result, hit.prefilled.result) == ("miss", "hit")
    assert miss.finished.token_ids == hit.finished.token_ids == bypass.finished.token_ids == eager.finished.token_ids
    replays = graphs.replays - before
    assert replays["chunks"] >= 2 and replays["decode"] >= 6  # the miss's and hit's suffix chunks, each decode step
    # on CUDA every step is a real graph (a failed capture runs eagerly, and would pass the rest unseen)
    assert (graphs.num_failed, graphs.num_captured) == (0, graphs.num_graphs if torch.cuda.is_available() else 0)


def test_decode_rows_beside_prompt_chunks_replay_one_graph_and_keep_each_requests_tokens(window_on_graphs):
    """A request arrives while another decodes: the steps of its prompt chunks beside that decode
    row are replayed, and each request gets the tokens it gets alone on the eager engine; the
    cached group is unharmed by the padding (a hit after gives the same tokens)."""
    runtime, graphs = window_on_graphs
    long, short = (body(TOOL, q, max_tokens=n, tool_choice="none") for q, n in ((QUESTIONS[4], 8), (QUESTIONS[2], 3)))

    def eager_alone() -> list[tuple[int, ...]]:
        generate(runtime, body(TOOL, "warm", max_tokens=1))
        return [generate(runtime, r).finished.token_ids for r in (long, short)]

    alone = eagerly(runtime, graphs, eager_alone)
    assert len(alone[0]) == 8  # it decodes all along
    mixed = graphs.replays["mixed"]

    async def main() -> list[tuple[int, ...]]:
        decoding = asyncio.Event()
        first = asyncio.create_task(_tokens(runtime, long, decoding))
        await decoding.wait()
        second = await _tokens(runtime, short)
        return [await first, second]

    assert asyncio.run(main()) == alone
    assert graphs.replays["mixed"] >= mixed + 1
    assert generate(runtime, short).finished.token_ids == alone[1]


async def _tokens(runtime: Runtime, request: dict[str, Any], decoding: asyncio.Event | None = None) -> tuple[int, ...]:
    """A request's tokens; `decoding` is set once its first token is chosen (it decodes from then)."""
    prepared = runtime.service.prepare(ChatCompletionRequest.model_validate(request))
    async for event in runtime.service.events(prepared):
        if isinstance(event, Prefilled) and decoding is not None:
            decoding.set()
        elif isinstance(event, Finished):
            return event.token_ids
    raise AssertionError("no Finished event")


def test_on_graphs_batch_invariant_requests_batched_give_their_tokens_alone(runtime_for):
    """A chunk alone runs its padded graph; batched, it runs eagerly over as many rows (the kernels'
    eager batched steps: the batched side of this test)."""
    runtime = runtime_for("qwen2", batch_invariant=True, **SMALL)
    graphs = use_graphs(runtime)
    requests = [body(TOOL, q, max_tokens=3) for q in ("hi", "Top sellers?", "Stock of item 7?")]
    alone = [generate(runtime, r) for r in requests]
    together = run_together(runtime, [(r, False) for r in requests])
    assert [run.finished.token_ids for run in together] == [run.finished.token_ids for run in alone]
    assert [run.text for run in together] == [run.text for run in alone]
    assert graphs.replays["chunks"] >= 3 and "mixed" not in graphs.replays


def test_the_graphs_of_chunk_steps_are_in_the_cache_key_where_they_are_captured():
    """A chunk replayed from a graph rounds over its bucket's rows: KV computed with graphs of one
    size is never served to a server with other graphs, or none (CUDA only: the CPU has none)."""
    def kernels(device: str, **overrides: object) -> str:
        return engine_plan(load_settings(overrides=overrides, environ={}), torch.device(device)).kernels

    assert kernels("cuda").endswith("-graphs512") and kernels("cuda", cuda_graph_max_tokens=100).endswith("-graphs100")
    assert "graphs" not in kernels("cuda", cuda_graphs=False) + kernels("cuda", cuda_graph_max_tokens=0)
    assert "graphs" not in kernels("cpu") + kernels("cpu", attention_backend="triton")
    assert (flat_buckets(512), flat_buckets(100), flat_buckets(0)) == ((16, 32, 64, 128, 256, 512), (16, 32, 64), ())


def test_a_one_token_chunk_after_a_longer_one_replays_and_matches_the_eager_step(window_on_graphs):
    """A prompt's last chunk can be one token, behind another sequence's longer chunk (or between
    two): the step replays the graph with decode rows (the one-token row is the decode kernel's)
    and gives the eager step's logits."""
    runtime, graphs = window_on_graphs
    runner = runtime.engine.runner
    for sizes in ((20, 1), (1, 20, 1)):
        tokens = [list(range(7, 7 + size)) for size in sizes]

        def both() -> tuple[torch.Tensor, torch.Tensor]:
            runs = [runner.pool.allocate(32) for _ in sizes]  # noqa: B023  # called at once, in this iteration
            rows = [RowKV(None, run, 0, 0) for run in runs if run is not None]
            try:
                replayed = runner.forward(tokens, rows).clone()  # noqa: B023
                runner.graphs = None
                return replayed, runner.forward(tokens, rows)  # noqa: B023
            finally:
                runner.graphs = graphs
                for run in runs:
                    if run is not None:
                        run.release()

        mixed = graphs.replays["mixed"]
        replayed, eager = runtime.engine.call(both).result()
        assert graphs.replays["mixed"] == mixed + 1 and replayed.shape == (len(sizes), eager.shape[1]), sizes
        torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
