"""A cached prefix: its key, its per-layer KV tensors, and what is needed to verify and list it.

The key (`PrefixKey`, made under a `CacheIdentity`): an entry is valid for a prompt only if
everything that determines its KV matches: the model weights and numerics, the tokenizer and
template, the adapter, and the exact prefix token ids. The digest is sha256 over all of them (never
Python's `hash()`, which is salted per process); the token ids are also stored and compared on
every hit.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from gateway.kvcache.block_pool import BlockRun


KEY_FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    """Everything but the tokens that decides what KV a prefix produces."""

    model_fingerprint: str
    tokenizer_fingerprint: str
    adapter_version: str
    salt: str = ""  # per-tenant namespace (empty: the shared namespace)

    def digest_bytes(self) -> bytes:
        blob = json.dumps(
            [KEY_FORMAT_VERSION, self.model_fingerprint, self.tokenizer_fingerprint,
             self.adapter_version, self.salt],
            separators=(",", ":"),
        )
        return blob.encode()


@dataclass(frozen=True, slots=True)
class PrefixKey:
    digest: str
    token_ids: tuple[int, ...]

    @classmethod
    def of(cls, identity: CacheIdentity, token_ids: list[int] | tuple[int, ...]) -> PrefixKey:
        ids = tuple(int(t) for t in token_ids)
        hasher = hashlib.sha256(identity.digest_bytes())
        hasher.update(b"\x00")
        hasher.update(np.asarray(ids, dtype="<i8").tobytes())
        return cls(digest=hasher.hexdigest(), token_ids=ids)

    def __len__(self) -> int:
        return len(self.token_ids)


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
