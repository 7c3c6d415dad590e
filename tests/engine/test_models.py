"""The models the runner drives (engine/models/): toolkv's own for the Llama family gives
transformers' greedy tokens and its logprobs to float rounding, on tiny random models of every
family and variant it covers; any other architecture runs on transformers' eager fallback, which
`/version` names; a model neither computes correctly (Gemma 2's logit softcap) is refused at load."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from gateway.engine import attention, models
from gateway.engine.model_loader import load_model
from gateway.engine.model_runner import Backend, ModelRunner, RowKV
from gateway.engine.models import UnsupportedModel
from gateway.kvcache.block_pool import BlockPool, PoolShape
from gateway.metrics import Metrics
from gateway.serving.runtime import build_runtime
from gateway.settings import load_settings
from tests.engine.conftest import Run, generate

DIMS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
FAMILIES: dict[str, tuple[Any, dict[str, Any]]] = {
    "llama": (LlamaConfig, {}),
    "llama3.2 (tied embeddings, llama3 RoPE scaling, biases)": (
        LlamaConfig, {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE, "attention_bias": True,
                      "mlp_bias": True}),
    "mistral (sliding window)": (MistralConfig, {"sliding_window": 8}),
    "qwen2 (qkv bias)": (Qwen2Config, {}),
    "qwen3 (q/k norm)": (Qwen3Config, {"head_dim": 16}),
    "qwen3 (tied embeddings, MHA)": (Qwen3Config, {"head_dim": 16, "tie_word_embeddings": True,
                                                  "num_key_value_heads": 4}),
}


def tiny(config_class: Any, seed: int = 0, **extra: Any) -> Any:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_class(**{**DIMS, **extra})).eval()
    for parameter in model.parameters():  # norm weights away from 1 and biases away from 0: they must be used
        if parameter.dim() == 1:
            nn.init.normal_(parameter, 1.0 if parameter.abs().mean() > 0.5 else 0.0, 0.2)
    return model


def reference_greedy(model: Any, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """transformers' own forward over the whole sequence at each step."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            scores = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            ids.append(int(scores.argmax()))
            logprobs.append(float(scores.max()))
    return ids[len(prompt):], logprobs


def runner_greedy(model: Any, prompt: list[int], steps: int, backend: Backend = "torch",
                  owned: bool = True) -> tuple[list[int], list[float]]:
    """The prompt in one chunk, then one decode step a token, over the pool."""
    config = model.config
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = PoolShape(config.num_hidden_layers, config.num_key_value_heads, dim, torch.float32)
    pool = BlockPool(shape, shape.bytes_per_token * 16 * 8, 16, torch.device("cpu"))
    step_model = models.build(model, backend, owned)
    assert step_model.kind == ("owned" if owned and models.supports(model) else "transformers")
    runner = ModelRunner(step_model, torch.device("cpu"), pool, backend=backend)
    run = pool.allocate(len(prompt) + steps)
    assert run is not None
    tokens, logprobs, done = [], [], 0
    new = list(prompt)
    for _ in range(steps):
        scores = runner.forward([new], [RowKV(None, run, done, done)])[0].float().log_softmax(-1)
        done += len(new)
        new = [int(scores.argmax())]
        tokens.append(new[0])
        logprobs.append(float(scores.max()))
    return tokens, logprobs


PROMPT = [5, 17, 99, 3, 250, 41, 8, 8, 120, 77, 64, 1, 33, 200, 19, 4, 90, 150]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_owned_model_gives_transformers_tokens_and_logprobs(family):
    config_class, extra = FAMILIES[family]
    model = tiny(config_class, **extra)
    expected_tokens, expected_logprobs = reference_greedy(model, PROMPT, 8)
    assert models.supports(model)
    tokens, logprobs = runner_greedy(model, PROMPT, 8)
    assert tokens == expected_tokens
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)


@pytest.mark.skipif(not attention.available(torch.device("cpu")), reason="needs Triton (its interpreter)")
def test_the_owned_model_on_the_triton_kernels_gives_transformers_tokens():
    """The fused kernels (q/k norm, RoPE and KV write in the attention launches) over the pool."""
    model = tiny(Qwen3Config, head_dim=16)
    expected_tokens, expected_logprobs = reference_greedy(model, PROMPT[:12], 4)
    tokens, logprobs = runner_greedy(model, PROMPT[:12], 4, backend="triton")
    assert tokens == expected_tokens
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)


def test_an_architecture_the_owned_model_does_not_cover_runs_transformers_own_and_gives_its_tokens():
    """Gemma 3 (q/k norm, local and global layers of different RoPE, sliding windows) on the
    fallback: transformers' model, toolkv's paged attention."""
    model = tiny(Gemma3TextConfig, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                 layer_types=["sliding_attention", "full_attention"])
    expected_tokens, expected_logprobs = reference_greedy(model, PROMPT, 6)  # before toolkv's attention is set
    assert not models.supports(model)
    tokens, logprobs = runner_greedy(model, PROMPT, 6)
    assert tokens == expected_tokens
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)


def test_gemma_2_is_refused_at_load_naming_its_attention_softcap():
    model = tiny(Gemma2Config, head_dim=16)
    with pytest.raises(UnsupportedModel, match="softcapping"):
        models.build(model, "torch")


def test_a_model_with_layers_it_does_not_know_runs_transformers_own(tiny_model_dir):
    """A linear that is neither a plain `nn.Linear` nor a bitsandbytes nf4/int8 layer: the model
    runs on the fallback, and the cache key says so."""
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "disk_budget_bytes": 0}, environ={})
    loaded = load_model(settings)

    class Other(nn.Linear):
        pass

    mlp = loaded.model.model.layers[1].mlp
    other = Other(mlp.up_proj.in_features, mlp.up_proj.out_features, bias=False)
    other.load_state_dict(mlp.up_proj.state_dict())
    mlp.up_proj = other
    assert not models.supports(loaded.model)
    runtime = build_runtime(settings, Metrics(), loaded)
    try:
        assert runtime.engine_info()["model_impl"] == "transformers"
        assert "owned" not in runtime.engine.info.identity.adapter_version  # type: ignore[union-attr]
    finally:
        runtime.engine.stop()


def _body(tools: list[dict[str, Any]], max_tokens: int = 12) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "You are a merchant assistant."},
                         {"role": "user", "content": "Which products sold best last week, by region?"}],
            "tools": tools, "temperature": 0, "max_tokens": max_tokens, "logprobs": True, "top_logprobs": 3}


def _assert_same_output(owned: Run, plain: Run) -> None:
    assert owned.finished.token_ids == plain.finished.token_ids
    assert owned.text == plain.text
    for a, b in zip(owned.logprobs, plain.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral-window"])
def test_served_the_owned_model_answers_as_transformers_own(runtime_for, merchant_tools, arch):
    """A miss and a hit on the owned model, against the same checkpoint on transformers' eager
    fallback (`fused_layers = false`), in float32; `/version` names which ran."""
    owned, plain = runtime_for(arch, dtype="float32"), runtime_for(arch, dtype="float32", fused_layers=False)
    assert (owned.engine_info()["model_impl"], plain.engine_info()["model_impl"]) == ("owned", "transformers")
    request = _body(merchant_tools[:4])
    miss, hit = generate(owned, request), generate(owned, request)
    assert (miss.prefilled.result, hit.prefilled.result) == ("miss", "hit")
    assert hit.finished.token_ids == miss.finished.token_ids
    _assert_same_output(miss, generate(plain, request))


def test_the_owned_model_adds_no_weight_memory(runtime_for):
    """The fused products' weights replace the checkpoint's (which become views into them)."""
    owned, plain = runtime_for("qwen3"), runtime_for("qwen3", fused_layers=False)
    assert owned.engine.runner.weights_bytes == plain.engine.runner.weights_bytes


def test_kv_computed_by_one_model_is_never_served_to_the_other(runtime_for, merchant_tools, tmp_path):
    """Which model ran is in the cache key: a group stored on disk by the owned model is a miss
    for a server on transformers' fallback over the same cache dir, and a disk hit for an owned one."""
    request = _body(merchant_tools[:4])
    assert generate(runtime_for("llama", cache_dir=str(tmp_path)), request).prefilled.result == "miss"
    plain = generate(runtime_for("llama", cache_dir=str(tmp_path), fused_layers=False), request)
    assert plain.prefilled.result == "miss"
    again = generate(runtime_for("llama", cache_dir=str(tmp_path)), request)
    assert (again.prefilled.result, again.prefilled.tier) == ("hit", "disk")
