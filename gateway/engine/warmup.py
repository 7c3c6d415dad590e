"""Warm-up: what a first request would otherwise pay once, run before the server says it is ready
(one pass of each shape the engine runs: a whole prompt chunk and one decode row, so kernels
compile and allocators settle; on CUDA the step graphs are captured)."""

from __future__ import annotations

import logging
import time

import torch

from gateway.engine.cuda_graphs import StepGraphs, flat_buckets
from gateway.engine.model_runner import ModelRunner, RowKV

log = logging.getLogger(__name__)


def warm_up(runner: ModelRunner, chunk_tokens: int, max_batch: int, graph_tokens: int | None) -> None:
    """`graph_tokens`: capture CUDA graphs, of chunk steps up to that many tokens (None: none)."""
    started = time.perf_counter()
    pool = runner.pool
    chunk = max(1, min(chunk_tokens, pool.num_blocks * pool.block_tokens - 1))
    run = pool.allocate(chunk + 1)
    if run is not None:
        try:
            runner.forward([[0] * chunk], [RowKV(None, run, 0, 0)])
            runner.forward([[0]], [RowKV(None, run, chunk, chunk)])
        finally:
            run.release()
    if graph_tokens is not None:
        graphs = StepGraphs(runner, max_batch, flat_buckets(graph_tokens))
        try:
            graphs.capture()
            runner.use_graphs(graphs)
        except Exception:  # a model whose forward cannot be captured still serves, eagerly
            log.warning("CUDA graph capture failed; decode runs eagerly", exc_info=True)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    log.info("engine warm-up: %.1fs (%s attention, batch invariant %s, CUDA graphs %s)",
             time.perf_counter() - started, runner.backend, runner.batch_invariant, runner.graphs is not None)
