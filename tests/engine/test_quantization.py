"""`quantization = "nf4" | "int8"`: bitsandbytes' weights on toolkv's own model (fused q/k/v and
gate/up over the checkpoint's quantized tensors, models/quantized.py), on the CPU as on CUDA.
The owned model gives the quantized transformers model's greedy tokens and its logprobs to float
rounding, a cached prefix gives the same tokens as computing it, and `/version` says which
quantization runs. Runs wherever bitsandbytes is installed (a test dependency)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.engine import models
from gateway.engine.model_loader import ModelLoadError, load_model
from gateway.engine.models.llama import LlamaModel
from gateway.settings import load_settings
from tests.engine.conftest import generate
from tests.engine.test_cached_equals_uncached import body
from tests.engine.test_models import PROMPT, reference_greedy, runner_greedy

pytest.importorskip("bitsandbytes")
QUANTIZATIONS = ["nf4", "int8"]
# bitsandbytes logs a warning on every int8 product of float32 activations (cast to float16 first,
# as toolkv's int8 product does too)
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def load(model_dir: Path, quantization: str) -> Any:
    settings = load_settings(overrides={"model": str(model_dir), "quantization": quantization,
                                        "disk_budget_bytes": 0}, environ={})
    return load_model(settings).model


@pytest.mark.parametrize(("arch", "quantization"), [("qwen3", "nf4"), ("qwen2", "int8")])  # q/k norm; biases
def test_the_owned_model_gives_the_quantized_transformers_tokens_and_logprobs(tiny_model_dir, arch, quantization):
    model = load(tiny_model_dir(arch), quantization)
    expected_tokens, expected_logprobs = reference_greedy(model, PROMPT, 8)
    assert models.supports(model)
    tokens, logprobs = runner_greedy(model, PROMPT, 8)
    assert tokens == expected_tokens
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_the_checkpoints_quantized_tensors_become_views_of_the_fused_products(tiny_model_dir, quantization):
    model = load(tiny_model_dir("llama"), quantization)
    owned = models.build(model, "torch")
    assert isinstance(owned, LlamaModel) and owned.quantization == quantization
    attn = model.model.layers[1].self_attn
    fused = owned.layers[1].qkv
    weights = fused.packed if quantization == "nf4" else fused.codes
    q_bytes = attn.q_proj.weight.data.numel() * attn.q_proj.weight.data.element_size()
    assert attn.q_proj.weight.data.data_ptr() == weights.data_ptr()
    assert attn.k_proj.weight.data.data_ptr() == weights.data_ptr() + q_bytes
    assert weights.dtype == (torch.uint8 if quantization == "nf4" else torch.int8)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_quantized_miss_hit_and_bypass_give_identical_greedy_tokens(runtime_for, merchant_tools, quantization):
    runtime = runtime_for("qwen2", quantization=quantization)
    assert (runtime.engine_info()["quantization"], runtime.engine_info()["model_impl"]) == (quantization, "owned")
    request = body(merchant_tools[:6], max_tokens=12)
    miss, hit, plain = generate(runtime, request), generate(runtime, request), generate(runtime, request, bypass=True)
    assert (miss.prefilled.result, hit.prefilled.result, plain.prefilled.result) == ("miss", "hit", "bypass")
    assert miss.finished.token_ids == hit.finished.token_ids == plain.finished.token_ids
    assert len(miss.finished.token_ids) == 12


def test_quantization_where_bitsandbytes_cannot_run_it_stops_start_up_naming_the_setting(tiny_model_dir):
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "quantization": "nf4",
                                        "device": "mps"}, environ={})
    with pytest.raises(ModelLoadError, match="quantization 'nf4' runs on CUDA or the CPU"):
        load_model(settings)


def test_a_gguf_is_quantized_from_its_converted_copy(tiny_gguf, tmp_path):
    """The copy's config records the GGUF it came from; its weights are floats, quantized as any
    checkpoint's (a first start converts, writes the copy and loads it as every later start does)."""
    settings = load_settings(overrides={"model": str(tiny_gguf), "quantization": "int8", "cache_dir": str(tmp_path)},
                             environ={})
    model = load_model(settings).model
    assert models.llama.quantization(model) == "int8" and models.supports(model)
