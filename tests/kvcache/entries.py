"""Cache entries with known tensors, for tier tests (also imported by the writer subprocesses)."""

from __future__ import annotations

from pathlib import Path

import torch

from gateway.kvcache.disk_tier import DiskTier
from gateway.kvcache.entry import CacheEntry, CacheIdentity, LayerKV, PrefixKey

IDENTITY = CacheIdentity("model-a", "tokenizer-a", "chatml-1")
OTHER_MODEL = CacheIdentity("model-b", "tokenizer-a", "chatml-1")


def make_entry(token_ids: list[int], *, identity: CacheIdentity = IDENTITY, seed: int = 0,
               num_layers: int = 2, dtype: torch.dtype = torch.float32, seq_len: int | None = None,
               cumulative_length: int | None = None, group_id: str = "tg_test") -> CacheEntry:
    """An entry whose tensors depend only on `seed`; includes -0.0 and a NaN, so that only a
    bitwise comparison can call two of them equal."""
    generator = torch.Generator().manual_seed(seed)
    seq = seq_len if seq_len is not None else len(token_ids)
    layers = []
    for _ in range(num_layers):
        keys, values = (torch.randn(1, 2, seq, 8, generator=generator).to(dtype) for _ in range(2))
        keys.view(-1)[0], values.view(-1)[0] = -0.0, float("nan")
        layers.append(LayerKV(keys, values, cumulative_length))
    return CacheEntry(key=PrefixKey.of(identity, token_ids), layers=tuple(layers), group_id=group_id,
                      tool_names=("get_order", "refund"))


def bitwise_equal(a: CacheEntry, b: CacheEntry) -> bool:
    if len(a.layers) != len(b.layers):
        return False
    for x, y in zip(a.layers, b.layers, strict=True):
        if x.cumulative_length != y.cumulative_length:
            return False
        for s, t in ((x.keys, y.keys), (x.values, y.values)):
            if s.dtype != t.dtype or s.shape != t.shape or not torch.equal(_raw(s), _raw(t)):
                return False
    return True


def disk(root: Path, budget_bytes: int = 1 << 30, identity: CacheIdentity = IDENTITY) -> DiskTier:
    return DiskTier(root, budget_bytes, identity)


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)
