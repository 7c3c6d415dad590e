"""On CUDA only (skipped without a GPU): once the engine is warm, serving compiles no Triton
kernel. A kernel variant compiled on a request costs it ~1 s on a fresh machine; Triton compiles
one per pattern of 16-byte-aligned pointer arguments, so a step whose layout rows fall otherwise
than the warm-up's (a second chunk of a group with an odd tile count, several prompts in one eager
step) would compile while serving."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import generate
from tests.engine.test_batching import body, run_together

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")


def compiled_variants() -> int:
    from gateway.engine import triton_kernels

    total = 0
    for kernel in (triton_kernels.decode, triton_kernels.combine, triton_kernels.prefill):
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            pytest.skip("this Triton keeps no per-device kernel cache to count")
        total += sum(len(cache[0]) for cache in caches.values())
    return total


def test_after_warm_up_serving_compiles_no_kernel(runtime_for, merchant_tools):
    runtime = runtime_for("llama", attention_backend="triton", max_batch=4)
    assert runtime.engine.runner.graphs is not None and runtime.engine.runner.graphs.num_failed == 0
    warm = compiled_variants()
    # a group of several chunks (the last one's tile count odd), a hit, then prompts of two new
    # groups and a bypass in eager steps of several rows, beside decode rows
    first = generate(runtime, body(merchant_tools[:20], "Refunds?", max_tokens=4))
    assert first.prefilled.result == "miss"
    assert generate(runtime, body(merchant_tools[:20], "Returns?", max_tokens=4)).prefilled.result == "hit"
    run_together(runtime, [(body(merchant_tools[20:35], "Stock?", max_tokens=6), False),
                           (body(merchant_tools[35:47], "Orders?", max_tokens=6), False),
                           (body(merchant_tools[:20], "Refunds?", max_tokens=6), True)])
    assert compiled_variants() == warm
