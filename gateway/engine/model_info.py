"""What the engine and the chat service read off the model and tokenizer, built once when the model
loads: the KV pool's shape, the end-of-sequence ids, the special ids the output text must not show,
how many logits the model gives, and the cache identity."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gateway.engine.tokenizer import Tokenizer
from gateway.kvcache.block_pool import PoolShape
from gateway.kvcache.entry import CacheIdentity


@dataclass(frozen=True, slots=True)
class ModelInfo:
    eos_ids: frozenset[int]
    special_ids: frozenset[int]
    vocab_size: int  # logits per position (at least the tokenizer's vocabulary)
    num_token_ids: int  # token ids the tokenizer knows and the model scores (logits may be padded past them)
    identity: CacheIdentity | None = None  # None: a tokenizer without a model (rendering only)
    pool_shape: PoolShape | None = None

    @classmethod
    def of(cls, model: Any | None, tokenizer: Tokenizer, identity: CacheIdentity | None = None) -> ModelInfo:
        """`model` None: what the tokenizer alone tells (a service that only renders prompts)."""
        scored = int(getattr(model.config, "vocab_size", 0) or 0) if model is not None else 0
        return cls(eos_ids=eos_ids(model, tokenizer) if model is not None else frozenset(),
                   special_ids=special_ids(tokenizer) if model is not None else frozenset(),
                   vocab_size=max(scored, len(tokenizer)),
                   num_token_ids=min(len(tokenizer), scored) if scored else len(tokenizer), identity=identity,
                   pool_shape=pool_shape(model) if model is not None else None)

    @property
    def fingerprint_bytes(self) -> bytes:
        return self.identity.digest_bytes() if self.identity is not None else b""


def pool_shape(model: Any) -> PoolShape:
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dtype = model.dtype if model.dtype.is_floating_point else torch.float16
    return PoolShape(config.num_hidden_layers, kv_heads, head_dim, dtype)


def eos_ids(model: Any, tokenizer: Tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    vocab = tokenizer.get_vocab()
    for token in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<|eom_id|>"):
        if token in vocab:
            ids.add(vocab[token])
    return frozenset(ids)


def special_ids(tokenizer: Tokenizer) -> frozenset[int]:
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(int(i) for i, token in decoder.items() if getattr(token, "special", False))
    return frozenset(ids)
