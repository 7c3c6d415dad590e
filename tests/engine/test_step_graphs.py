"""Steps replayed from captured graphs (engine/cuda_graphs.py): decode steps, prompt chunks alone,
and decode rows beside prompt chunks give the tokens the eager engine gives, a hit, a miss and a
bypass still agree, and with `batch_invariant` batched still equals alone. On a machine without a
GPU a graph re-runs its step on the same static buffers (through Triton's interpreter), so the
buffers, padding and layouts are what is checked here; on CUDA the graphs are real."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from gateway.engine import Finished, Prefilled
from gateway.engine.cuda_graphs import StepGraphs, flat_buckets
from gateway.engine.model_runner import RowKV
from gateway.protocol.chat import ChatCompletionRequest
from gateway.serving.runtime import Runtime, engine_plan
from gateway.settings import load_settings
from tests.engine.conftest import generate
from tests.engine.test_batching import QUESTIONS, body, run_together

pytest.importorskip("triton")
SIZES = (16, 32)  # small buckets and batches: the interpreter runs every padding row and tile
SMALL = {"attention_backend": "triton", "max_batch": 4}


def use_graphs(runtime: Runtime) -> StepGraphs:
    engine = runtime.engine

    def capture() -> StepGraphs:
        graphs = StepGraphs(engine.runner, engine.max_batch, SIZES)
        graphs.capture()
        engine.runner.use_graphs(graphs)
        return graphs

    return engine.call(capture).result()  # type: ignore[no-any-return]


def test_on_graphs_a_hit_a_miss_and_a_bypass_give_the_eager_engines_tokens(runtime_for, merchant_tools):
    runtime = runtime_for("llama", batch_invariant=False, **SMALL)
    request = body(merchant_tools[:2], "Refunds?", max_tokens=6)
    eager = generate(runtime, request, bypass=True)
    graphs = use_graphs(runtime)
    miss, hit, bypass = generate(runtime, request), generate(runtime, request), generate(runtime, request, bypass=True)
    assert (miss.prefilled.result, hit.prefilled.result) == ("miss", "hit")
    assert miss.finished.token_ids == hit.finished.token_ids == bypass.finished.token_ids == eager.finished.token_ids
    assert graphs.replays["chunks"] >= 3 and graphs.replays["decode"] >= 15  # the suffix chunk, each decode step
    # on CUDA every step is a real graph (a failed capture runs eagerly, and would pass the rest unseen)
    assert (graphs.num_failed, graphs.num_captured) == (0, graphs.num_graphs if torch.cuda.is_available() else 0)


def test_decode_rows_beside_prompt_chunks_replay_one_graph_and_keep_each_requests_tokens(runtime_for, merchant_tools):
    """A request arrives while another decodes: the steps of its prompt chunks beside that decode
    row are replayed, and each request gets the tokens it gets alone on the eager engine; the
    cached group is unharmed by the padding (a hit after gives the same tokens). A model with a
    sliding window, so the window reaches the kernels too."""
    runtime = runtime_for("mistral-window", batch_invariant=False, prefill_chunk_tokens=16, **SMALL)
    tools = merchant_tools[:2]
    long, short = (body(tools, q, max_tokens=n, tool_choice="none") for q, n in ((QUESTIONS[4], 12), (QUESTIONS[2], 4)))
    generate(runtime, body(tools, "warm", max_tokens=1))
    alone = [generate(runtime, r).finished.token_ids for r in (long, short)]
    assert len(alone[0]) == 12  # it decodes all along
    graphs = use_graphs(runtime)

    async def main() -> list[tuple[int, ...]]:
        decoding = asyncio.Event()
        first = asyncio.create_task(_tokens(runtime, long, decoding))
        await decoding.wait()
        second = await _tokens(runtime, short)
        return [await first, second]

    assert asyncio.run(main()) == alone
    assert graphs.replays["mixed"] >= 1
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


def test_on_graphs_batch_invariant_requests_batched_give_their_tokens_alone(runtime_for, merchant_tools):
    """A chunk alone runs its padded graph; batched, it runs eagerly over as many rows."""
    runtime = runtime_for("qwen2", batch_invariant=True, **SMALL)
    graphs = use_graphs(runtime)
    requests = [body(merchant_tools[:2], q, max_tokens=5) for q in ("hi", "Top sellers?", "Stock of item 7?")]
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


@pytest.mark.parametrize("sizes", [(20, 1), (1, 20, 1)])
def test_a_one_token_chunk_after_a_longer_one_replays_and_matches_the_eager_step(runtime_for, sizes):
    """A prompt's last chunk can be one token, behind another sequence's longer chunk: the step
    replays the graph with decode rows (the one-token row is the decode kernel's) and gives the
    eager step's logits."""
    runtime = runtime_for("llama", batch_invariant=False, **SMALL)
    graphs = use_graphs(runtime)
    runner = runtime.engine.runner
    tokens = [list(range(7, 7 + size)) for size in sizes]

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        runs = [runner.pool.allocate(32) for _ in sizes]
        rows = [RowKV(None, run, 0, 0) for run in runs if run is not None]
        try:
            replayed = runner.forward(tokens, rows).clone()
            runner.graphs = None
            return replayed, runner.forward(tokens, rows)
        finally:
            runner.graphs = graphs
            for run in runs:
                if run is not None:
                    run.release()

    replayed, eager = runtime.engine.call(both).result()
    assert graphs.replays["mixed"] == 1 and replayed.shape == (len(sizes), eager.shape[1])
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
