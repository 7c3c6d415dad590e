"""`toolkv_memory_bytes{part}`: what the engine holds on its device, for the weights, the KV pool and
the CUDA graphs. On the CPU the weights are the tiny model's parameters times their dtype's size,
the pool is what `ram_budget_bytes` bought, and there are no graphs."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gateway.engine.cuda_graphs import pool_bytes
from gateway.engine.stats import EngineStats, MemoryUse
from gateway.metrics import Metrics
from tests.observability.traffic import scrape
from tests.support.server import LiveServer

POOL_BYTES = 4 * 2**20


@pytest.fixture(scope="module")
def server(start_gateway: Callable[..., LiveServer]) -> LiveServer:
    return start_gateway(ram_budget_bytes=POOL_BYTES)


def _stats(memory: MemoryUse | None) -> EngineStats:
    return EngineStats(running=0, waiting=0, kv_blocks_total=0, kv_blocks_used=0, kv_blocks_cached=0,
                       kv_block_tokens=0, preemptions_total=0, prefix_queries_tokens_total=0,
                       prefix_hits_tokens_total=0, steps_total=0, cancelled_total=0, memory=memory)


def _memory_samples(metrics: Metrics) -> dict[str, float]:
    return {s.labels["part"]: s.value for family in metrics.registry.collect() for s in family.samples
            if s.name == "toolkv_memory_bytes"}


def test_runner_counts_the_weights_once_each_and_the_whole_pool(server: LiveServer) -> None:
    runtime = server.app.state.gateway.model.runtime
    model, runner = runtime.loaded.model, runtime.engine.runner
    # A tied weight is listed once; toolkv's own model (engine/models/llama.py) fuses q/k/v and
    # gate/up as views of these same tensors, so the checkpoint's weights, each once, are all of it.
    params = list(model.parameters())
    weights = sum(p.numel() for p in params) * params[0].element_size()  # one dtype for all
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # the rotary frequencies
    memory = runner.memory()
    assert memory.weights_bytes == weights + buffers and buffers < weights / 1000
    pool = runner.pool
    assert memory.kv_pool_bytes == pool.num_bytes + pool.shape.bytes_per_token  # the blocks, the scratch token
    assert POOL_BYTES - pool.block_tokens * pool.shape.bytes_per_token < pool.num_bytes <= POOL_BYTES
    assert memory.cuda_graphs_bytes == 0  # the CPU captures none


def test_the_gauge_has_one_series_per_part_once_the_engine_says() -> None:
    metrics = Metrics()
    metrics.observe_engine(_stats(None), [], "m")
    assert _memory_samples(metrics) == {}  # an engine that does not say exports nothing, not zeros
    metrics.observe_engine(_stats(MemoryUse(weights_bytes=540_000_000, kv_pool_bytes=2**31)), [], "m")
    assert _memory_samples(metrics) == {"weights": 540_000_000, "kv_pool": 2**31, "cuda_graphs": 0}


def test_a_gateway_exports_what_its_engine_holds(server: LiveServer) -> None:
    memory = server.app.state.gateway.model.runtime.engine.runner.memory()
    _, families = scrape(server)
    exported = {s.labels["part"]: s.value for s in families["toolkv_memory_bytes"].samples}
    assert exported == {"weights": memory.weights_bytes, "kv_pool": memory.kv_pool_bytes, "cuda_graphs": 0}


def test_graph_memory_is_the_segments_of_the_graphs_own_pool() -> None:
    segments = [{"total_size": 2**20, "segment_pool_id": (0, 0)},  # the caching allocator's own
                {"total_size": 3 * 2**20, "segment_pool_id": (1, 2)},
                {"total_size": 2**21, "segment_pool_id": (1, 2)},
                {"total_size": 2**22, "segment_pool_id": (1, 3)}]  # another graph pool
    assert pool_bytes(segments, (1, 2)) == 5 * 2**20
    assert pool_bytes(segments, None) == 0  # nothing captured
