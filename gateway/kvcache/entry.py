"""A cached prefix: its per-layer KV tensors plus what is needed to verify and list it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from gateway.kvcache.keys import PrefixKey


def spare_room(prefix_tokens: int) -> int:
    """Room kept after a stored prefix for the suffix and generated tokens of its hits: a quarter
    of the prefix, 64..1024 tokens. A request that needs more copies once, mid-decode."""
    return min(1024, max(64, prefix_tokens // 4))


@dataclass(frozen=True, slots=True)
class LayerKV:
    keys: torch.Tensor  # [batch=1, kv_heads, seq, head_dim]
    values: torch.Tensor
    cumulative_length: int | None = None  # sliding-window layers track the tokens seen
    # Buffers whose first `seq` positions are `keys`/`values` and whose rest is spare room for a
    # request's own tokens, so a hit appends in place instead of copying the prefix (the engine
    # runs one request at a time, and nothing ever writes the first `seq` positions).
    key_room: torch.Tensor | None = None
    value_room: torch.Tensor | None = None

    @classmethod
    def with_room(cls, keys: torch.Tensor, values: torch.Tensor) -> LayerKV:
        """A full-attention layer copied into buffers with spare room after it."""
        seq = keys.shape[-2]
        key_room = keys.new_empty((*keys.shape[:2], seq + spare_room(seq), keys.shape[-1]))
        value_room = values.new_empty((*values.shape[:2], seq + spare_room(seq), values.shape[-1]))
        key_room[:, :, :seq] = keys
        value_room[:, :, :seq] = values
        return cls(key_room[:, :, :seq], value_room[:, :, :seq], None, key_room, value_room)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What the layer holds in memory (the room buffers when it has them)."""
        if self.key_room is not None and self.value_room is not None:
            return self.key_room, self.value_room
        return self.keys, self.values


@dataclass(slots=True)
class CacheEntry:
    key: PrefixKey
    layers: tuple[LayerKV, ...]
    group_id: str
    tool_names: tuple[str, ...]
    compile_s: float = 0.0
    created_at: float = field(default_factory=time.time)
    last_used_at: float = field(default_factory=time.time)
    hits: int = 0
    num_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.num_bytes:
            self.num_bytes = sum(
                t.numel() * t.element_size() for layer in self.layers for t in layer.tensors()
            )

    @property
    def num_tokens(self) -> int:
        return len(self.key.token_ids)

    def matches(self, key: PrefixKey) -> bool:
        """Digest and the exact token ids must both agree (a digest alone is not trusted)."""
        return self.key.digest == key.digest and self.key.token_ids == key.token_ids

    def touch(self) -> None:
        self.hits += 1
        self.last_used_at = time.time()
