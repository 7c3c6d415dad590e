"""The engine's plan (gateway/engine/plan.py): the switches are resolved for the device and
checked together; a combination the engine does not run is refused naming the switch, never
half-applied. Model-free."""

from __future__ import annotations

import pytest
import torch

from gateway.engine import attention
from gateway.engine.plan import EnginePlan, PlanError, engine_plan
from gateway.settings import load_settings

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_cpu_defaults_are_the_torch_backend_batch_invariant_and_no_graphs() -> None:
    plan = engine_plan(load_settings(environ={}), CPU)
    assert (plan.backend, plan.batch_invariant, plan.chunk_tokens, plan.max_batch) == ("torch", True, 128, 8)
    assert (plan.graph_tokens, plan.overlap, plan.device) == (None, False, CPU)


def test_graphs_need_the_triton_backend_on_cuda_with_fused_layers() -> None:
    with pytest.raises(PlanError, match="CUDA graphs need the triton backend on CUDA"):
        EnginePlan(CPU, graph_tokens=512)
    if attention.available(CUDA):
        with pytest.raises(PlanError, match="fused False"):
            EnginePlan(CUDA, "triton", graph_tokens=512, fused=False)


def test_settings_that_ask_for_graphs_without_the_own_model_get_none() -> None:
    plan = engine_plan(load_settings(overrides={"fused_layers": False}, environ={}), CUDA)
    assert plan.graph_tokens is None and "graphs" not in plan.kernels


@pytest.mark.skipif(attention.interpreted(), reason="Triton's interpreter runs the kernels on the CPU")
def test_the_triton_backend_is_refused_where_its_kernels_cannot_run() -> None:
    with pytest.raises(PlanError, match="the triton backend needs CUDA and Triton"):
        EnginePlan(CPU, "triton")


@pytest.mark.parametrize("name", ["chunk_tokens", "max_batch", "block_tokens", "max_queue"])
def test_a_size_below_one_is_refused_by_name(name: str) -> None:
    with pytest.raises(PlanError, match=f"{name} must be at least 1"):
        EnginePlan(CPU, **{name: 0})  # type: ignore[arg-type]
