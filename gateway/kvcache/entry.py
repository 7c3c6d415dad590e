"""A cached prefix: its per-layer KV tensors plus what is needed to verify and list it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gateway.kvcache.keys import PrefixKey

if TYPE_CHECKING:
    from gateway.kvcache.block_pool import BlockRun


@dataclass(frozen=True, slots=True)
class LayerKV:
    keys: torch.Tensor  # [batch=1, kv_heads, seq, head_dim]
    values: torch.Tensor
    cumulative_length: int | None = None  # kept in the file format; the engine keeps every token

    def tensors(self) -> tuple[torch.Tensor, ...]:
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
    # The pool blocks `layers` are views of (None: tensors of their own, e.g. as read from disk).
    # Whoever keeps the entry (the RAM tier, a pending disk write) holds a reference to them.
    blocks: BlockRun | None = None
    # On CUDA, an event recorded once the KV was computed: a background copy (the disk writer's)
    # waits on it on a stream of its own, not on the engine's stream (`mark_computed`).
    computed: torch.cuda.Event | None = None

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

    def mark_computed(self) -> None:
        """Record, on the current stream, that the KV is computed (CUDA only: elsewhere it is)."""
        if self.layers and self.layers[0].keys.is_cuda:
            self.computed = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            self.computed.record()

    def retain(self) -> None:
        if self.blocks is not None:
            self.blocks.retain()

    def release(self) -> None:
        if self.blocks is not None:
            self.blocks.release()

    def release_later(self) -> None:
        """`release` from a thread that does not own the pool (the disk writer's)."""
        if self.blocks is not None:
            self.blocks.pool.release_later(self.blocks)

    def touch(self) -> None:
        self.hits += 1
        self.last_used_at = time.time()
