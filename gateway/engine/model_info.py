"""What the engine reads off the model and tokenizer: the KV pool's shape, the end-of-sequence
ids, and the special ids the output text must not show."""

from __future__ import annotations

from typing import Any

import torch

from gateway.engine.block_pool import PoolShape


def pool_shape(model: Any) -> PoolShape:
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dtype = model.dtype if model.dtype.is_floating_point else torch.float16
    return PoolShape(config.num_hidden_layers, kv_heads, head_dim, dtype)


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
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


def special_ids(tokenizer: Any) -> frozenset[int]:
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(int(i) for i, token in decoder.items() if getattr(token, "special", False))
    return frozenset(ids)
