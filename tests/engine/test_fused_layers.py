"""Fused decoder layers (engine/fused_layers.py): the same tokens and logprobs as transformers' own
layers up to float rounding, fewer ops per step, no added memory, and never KV of one served to
the other."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gateway.engine import fused_layers
from gateway.engine.model_loader import load_model
from gateway.metrics import Metrics
from gateway.serving.runtime import Runtime, build_runtime
from gateway.settings import load_settings
from tests.engine.conftest import Run, generate

ARCHS = ["llama", "qwen2", "mistral", "qwen3", "mistral-window"]
_VIEWS = {"alias", "slice", "select", "view", "transpose", "unsqueeze", "reshape", "unflatten", "flatten", "chunk",
          "split", "t", "expand", "detach", "to"}  # no kernel of their own (`to`: here a same-dtype no-op)


def body(tools: list[dict[str, Any]], max_tokens: int = 12) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "You are a merchant assistant."},
                         {"role": "user", "content": "Which products sold best last week, by region?"}],
            "tools": tools, "temperature": 0, "max_tokens": max_tokens, "logprobs": True, "top_logprobs": 3}


def assert_same_output(fused: Run, plain: Run) -> None:
    assert fused.finished.token_ids == plain.finished.token_ids
    assert fused.text == plain.text
    for a, b in zip(fused.logprobs, plain.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_layers_give_the_tokens_and_logprobs_of_transformers_layers(runtime_for, merchant_tools, arch):
    """A miss and a hit on the fused layers, against the same model on transformers' layers (in
    float32 on every device: the comparison is of the fusion, not of bfloat16's rounding)."""
    fused, plain = runtime_for(arch, dtype="float32"), runtime_for(arch, dtype="float32", fused_layers=False)
    assert fused_layers.is_fused(fused.engine.model) and not fused_layers.is_fused(plain.engine.model)
    request = body(merchant_tools[:4])
    miss, hit = generate(fused, request), generate(fused, request)
    assert (miss.prefilled.result, hit.prefilled.result) == ("miss", "hit")
    assert hit.finished.token_ids == miss.finished.token_ids
    assert_same_output(miss, generate(plain, request))


def test_a_model_fused_by_one_engine_runs_transformers_layers_again_in_the_next(runtime_for, merchant_tools,
                                                                                tiny_model_dir):
    """`fused_layers = false` on a model an earlier engine fused: its outputs are those of a model
    never fused, bit for bit (the weights left as views into the fused ones hold the same numbers)."""
    request = body(merchant_tools[:4])
    expected = generate(runtime_for("qwen3", dtype="float32", fused_layers=False), request)
    settings = load_settings(overrides={"model": str(tiny_model_dir("qwen3")), "min_prefix_tokens": 8,
                                        "disk_budget_bytes": 0, "dtype": "float32"}, environ={})
    loaded = load_model(settings)
    first = build_runtime(settings, Metrics(), loaded)
    first.engine.stop()
    assert fused_layers.is_fused(loaded.model)
    second = build_runtime(settings.model_copy(update={"fused_layers": False}), Metrics(), loaded)
    try:
        assert not fused_layers.is_fused(loaded.model)
        again = generate(second, request)
    finally:
        second.engine.stop()
    assert again.finished.token_ids == expected.finished.token_ids
    assert [e.logprob for e in again.logprobs] == [e.logprob for e in expected.logprobs]


def _ops_per_decode_step(runtime: Runtime, request: dict[str, Any]) -> int:
    """Ops (not views) dispatched by the last single-token forward of a request."""
    runner = runtime.engine.runner
    counts: list[int] = []
    original = runner.run

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.ops[func.__name__.split(".")[0]] += 1
            return func(*args, **(kwargs or {}))

    def run(ids: torch.Tensor, *rest: Any) -> torch.Tensor:
        with Count() as count:
            out = original(ids, *rest)
        if ids.shape[1] == 1:
            counts.append(sum(n for name, n in count.ops.items() if name not in _VIEWS))
        return out

    runner.run = run  # type: ignore[method-assign]
    try:
        generate(runtime, request)
    finally:
        del runner.run
    return counts[-1]


def test_a_fused_decode_step_runs_far_fewer_ops_and_adds_no_weight_memory(runtime_for, merchant_tools):
    """The point of fusing: a step launches fewer kernels (on a GPU, the launches bound a decode
    step). The fused weights replace the old ones: the model takes the same bytes."""
    fused, plain = runtime_for("qwen3"), runtime_for("qwen3", fused_layers=False)
    request = body(merchant_tools[:2], max_tokens=3)
    fused_ops, plain_ops = _ops_per_decode_step(fused, request), _ops_per_decode_step(plain, request)
    assert fused_ops <= 0.6 * plain_ops, (fused_ops, plain_ops)
    assert fused.engine.runner.weights_bytes == plain.engine.runner.weights_bytes


def test_kv_computed_by_one_kind_of_layer_is_never_served_to_the_other(runtime_for, merchant_tools, tmp_path):
    """The fusion is in the cache key: a group stored on disk by the fused layers is a miss for a
    server on transformers' layers over the same cache dir, and a disk hit for a fused one."""
    request = body(merchant_tools[:4])
    assert generate(runtime_for("llama", cache_dir=str(tmp_path)), request).prefilled.result == "miss"
    plain = generate(runtime_for("llama", cache_dir=str(tmp_path), fused_layers=False), request)
    assert plain.prefilled.result == "miss"
    again = generate(runtime_for("llama", cache_dir=str(tmp_path)), request)
    assert (again.prefilled.result, again.prefilled.tier) == ("hit", "disk")


def test_a_model_with_layers_it_does_not_know_keeps_transformers_layers(runtime_for, tiny_model_dir):
    """A linear that is not a plain `nn.Linear` (bitsandbytes' 4-bit layers are not) leaves the
    whole model unfused, and the cache key says so."""
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "disk_budget_bytes": 0}, environ={})
    loaded = load_model(settings)
    assert fused_layers.supports(loaded.model)

    class Other(nn.Linear):
        pass

    mlp = loaded.model.model.layers[1].mlp
    other = Other(mlp.up_proj.in_features, mlp.up_proj.out_features, bias=False)
    other.load_state_dict(mlp.up_proj.state_dict())
    mlp.up_proj = other
    assert not fused_layers.supports(loaded.model)
    runtime = build_runtime(settings, Metrics(), loaded)
    try:
        assert not fused_layers.is_fused(loaded.model)
        assert "fused" not in runtime.engine.info.identity.adapter_version  # type: ignore[union-attr]
    finally:
        runtime.engine.stop()


