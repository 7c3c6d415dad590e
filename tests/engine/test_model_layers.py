"""The owned models' elementwise kernels (engine/models/layers.py, engine/triton_kernels.py): the
Triton kernels give the torch path's numbers in every dtype, and a decoder layer's decode step on
the path the GPU runs launches at most 8 device kernels (9 for Qwen3), matrix products included.
On a machine without a GPU the kernels run under Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from gateway.engine import attention, models
from gateway.engine.model_runner import ModelRunner, RowKV
from gateway.engine.models.layers import Elementwise, TritonElementwise
from gateway.kvcache.block_pool import BlockPool, PoolShape

pytest.importorskip("triton")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# what launches no kernel: views, and allocations (memory from the caching allocator)
NO_KERNEL = {"alias", "slice", "select", "view", "transpose", "unsqueeze", "reshape", "unflatten", "flatten",
             "split", "split_with_sizes", "t", "expand", "detach", "_unsafe_view", "as_strided", "squeeze", "permute",
             "empty", "empty_like", "empty_strided", "new_empty"}


def _exact_in_float32(dtype: torch.dtype) -> dict[str, float]:
    # one rounding step apart at most (a sum rounded before or after the norm)
    return {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
            torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37])
def test_norm_add_and_silu_kernels_give_the_torch_paths_numbers(dtype, tokens):
    """Residual add + RMSNorm (the residual updated in place) and SiLU * up, rows that are not a
    multiple of the rows a program takes, a width that is not a power of two."""
    generator = torch.Generator().manual_seed(tokens)
    x, residual = (torch.randn(tokens, 96, generator=generator).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(96, generator=generator)).to(dtype)
    gate_up = torch.randn(tokens, 2 * 80, generator=generator).to(dtype)
    torch_ops, triton_ops = Elementwise(), TritonElementwise()
    expected, expected_sum = torch_ops.add_rms_norm(x, residual, weight, 1e-6)
    got, got_sum = triton_ops.add_rms_norm(x, residual.clone(), weight, 1e-6)
    # bit for bit, but in bfloat16 under the interpreter: it rounds float32 to bfloat16 toward zero
    exact = {"atol": 0, "rtol": 2**-7 if dtype == torch.bfloat16 and attention.interpreted() else 0}
    torch.testing.assert_close(got_sum, expected_sum, **exact)
    torch.testing.assert_close(got, expected, **_exact_in_float32(dtype))
    torch.testing.assert_close(triton_ops.rms_norm(x, weight, 1e-6), torch_ops.rms_norm(x, weight, 1e-6),
                               **_exact_in_float32(dtype))
    torch.testing.assert_close(triton_ops.silu_mul(gate_up), torch_ops.silu_mul(gate_up), **_exact_in_float32(dtype))


class _Launches(TorchDispatchMode):
    """Counts aten ops that run a kernel, and Triton launches (the interpreter's own torch work
    inside a launch is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.inside = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if not self.inside and name not in NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def counting_triton(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        from triton.runtime import interpreter

        launch = interpreter.GridExecutor.__call__

        def counted(executor: Any, *args: Any, **kwargs: Any) -> Any:
            self.ops[f"triton:{executor.fn.__name__}"] += 1
            self.inside += 1
            try:
                return launch(executor, *args, **kwargs)
            finally:
                self.inside -= 1

        with monkeypatch.context() as patch:
            patch.setattr(interpreter.GridExecutor, "__call__", counted)
            yield


def _decode_step_launches(config: Any, layers: int, monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    shape = PoolShape(layers, config.num_key_value_heads, config.head_dim, torch.float32)
    pool = BlockPool(shape, shape.bytes_per_token * 16 * 8, 16, torch.device("cpu"))
    runner = ModelRunner(models.build(model, "triton"), torch.device("cpu"), pool, backend="triton",
                         batch_invariant=False)  # the GPU's default
    run = pool.allocate(40)
    assert run is not None
    runner.forward([list(range(3, 8))], [RowKV(None, run, 0, 0)])
    launches = _Launches()
    with launches.counting_triton(monkeypatch), launches:
        runner.forward([[5]], [RowKV(None, run, 5, 5)])
    return launches.ops


FAMILIES = {
    "llama": (LlamaConfig, {}, 8),
    "mistral": (MistralConfig, {"sliding_window": 24}, 8),
    "qwen2": (Qwen2Config, {}, 8),
    "qwen3": (Qwen3Config, {}, 9),
}


@pytest.mark.skipif(not attention.interpreted(), reason="counted under Triton's interpreter (the CPU)")
@pytest.mark.parametrize("family", FAMILIES)
def test_a_decode_step_launches_at_most_eight_kernels_a_layer_nine_for_qwen3(family, monkeypatch):
    """Counted over the path the GPU runs (Triton backend, batch_invariant off): a layer's aten
    ops that run a kernel (the four products) and its Triton launches, as the difference between
    a model of three layers and one of two (embedding, final norm and head counted in neither)."""
    config_class, extra, most = FAMILIES[family]
    config = config_class(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, max_position_embeddings=512, **extra)
    two, three = (_decode_step_launches(config, layers, monkeypatch) for layers in (2, 3))
    per_layer = three - two
    assert sum(per_layer.values()) <= most, per_layer
    assert two - three == collections.Counter()  # nothing a layer does happens fewer times with more layers
    assert per_layer["triton:decode"] == 1 and "triton:rope_kv" not in per_layer  # attention: one launch
