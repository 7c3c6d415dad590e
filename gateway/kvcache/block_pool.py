"""The KV block pool: every key and value the engine computes lives here, preallocated once per
layer from `ram_budget_bytes`, so memory is bounded by the pool and not by traffic.

Memory is cut into fixed-size blocks of `block_tokens` tokens, ref-counted. A holder (a running
sequence, the RAM tier, a pending disk write) takes a *run*: consecutive blocks, so that a run's
keys for one layer are one strided view `[kv_heads, tokens, head_dim]` with no gather. Attention on
this CPU reads those views directly; gathering scattered pages into a contiguous tensor costs a
copy of the whole context per layer per step. On CUDA the Triton kernels (engine/attention.py)
read a sequence's two runs in place by their pool offsets.

A run is shared by reference counting: the tool group's run is held by the RAM tier and by every
sequence that uses it, and written by no one after its compile. Blocks whose count drops to zero
are free at once. The engine thread owns the counts (`Owner`, below): it alone allocates, writes,
retains and releases, so they need no lock. The disk writer, which holds a reference while it
copies a run to disk, hands the run back (`release_later`, a thread-safe deque: the one thread
boundary here), and the engine releases it at its next use of the pool or between its steps.

The owner is the one thread that changes the pool's block references and the prefix store's
in-memory state (the RAM tier's entries, LRU order and in-use counts): the engine's, once it runs.
Before the engine's thread starts (start-up, warm-up) and after it ends (shutdown), or with no
engine at all (the CLI, model-free tests), whoever holds the pool or the store is its only user and
may change it. While the engine runs, a change from any other thread is a bug, and `Owner.check`
raises at once (tests/kvcache/test_owner.py; tests/kvcache/test_cache_api.py shows the routes'
changes run on the engine's thread): that is what lets the RAM tier and the block pool go without
locks. Other threads hand work to the owner instead: routes through `engine.call`
(serving/store_admin.py), the disk writer by handing block runs back (`BlockPool.release_later`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gateway.kvcache.entry import LayerKV

Submit = Callable[[Callable[[], Any]], Any]  # runs a function on the owner's thread, soon (Engine.call)


class WrongThread(RuntimeError):
    """The store or the pool was changed off its owner's thread while the owner runs."""


class Owner:
    """The thread that alone changes what it owns while it runs (the module's docstring says why)."""

    __slots__ = ("_submit", "_thread")

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._submit: Submit | None = None

    def bind(self, thread: threading.Thread, submit: Submit | None = None) -> None:
        """`thread` owns from when it starts until it ends; `submit` runs a function on it."""
        self._thread, self._submit = thread, submit

    def held_elsewhere(self) -> bool:
        """Whether the owner runs now and this is not its thread."""
        thread = self._thread
        return thread is not None and thread.ident != threading.get_ident() and thread.is_alive()

    def check(self) -> None:
        """Raise WrongThread unless this thread may change what the owner owns (a cheap compare)."""
        if self.held_elsewhere():
            raise WrongThread(f"changed on thread {threading.current_thread().name!r} while "
                              f"{self._thread.name if self._thread else '?'!r} owns it: use engine.call")

    def soon(self, fn: Callable[[], Any]) -> bool:
        """Ask the owner to run `fn` between its steps; False when there is no running owner to
        ask, or it would not take it (its queue is full)."""
        if self._submit is None or not self.held_elsewhere():
            return False
        try:
            self._submit(fn)
        except Exception:  # a full queue: the owner runs `fn`'s work at its next use anyway
            return False
        return True


class BlockRun:
    """Consecutive blocks `[first, first + count)`, alive while someone holds a reference."""

    __slots__ = ("count", "first", "pool")

    def __init__(self, pool: BlockPool, first: int, count: int) -> None:
        self.pool = pool
        self.first = first
        self.count = count

    @property
    def token_start(self) -> int:
        return self.first * self.pool.block_tokens

    @property
    def capacity(self) -> int:
        return self.count * self.pool.block_tokens

    @property
    def block_ids(self) -> range:
        return range(self.first, self.first + self.count)

    def retain(self) -> None:
        self.pool.retain(self)

    def release(self) -> None:
        self.pool.release(self)

    def head(self, tokens: int) -> BlockRun:
        """A new reference to the blocks holding this run's first `tokens` tokens."""
        run = BlockRun(self.pool, self.first, min(self.count, max(1, self.pool.blocks_for(tokens))))
        run.retain()
        return run

    def copy_from(self, source: BlockRun, tokens: int) -> None:
        """Write `source`'s first `tokens` tokens of KV, every layer, into this run's first ones."""
        for layer in range(len(self.pool.keys)):
            self.keys(layer, 0, tokens).copy_(source.keys(layer, 0, tokens))
            self.values(layer, 0, tokens).copy_(source.values(layer, 0, tokens))

    def keys(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Layer `layer`'s keys for run-relative tokens `[start, end)`: a view `[kv_heads, n, dim]`."""
        base = self.token_start
        return self.pool.keys[layer][:, base + start: base + end]

    def values(self, layer: int, start: int, end: int) -> torch.Tensor:
        base = self.token_start
        return self.pool.values[layer][:, base + start: base + end]

    def entry_layers(self, tokens: int) -> tuple[LayerKV, ...]:
        """A cache entry's layers: `[1, kv_heads, tokens, dim]` views of this run's first tokens."""
        return tuple(LayerKV(self.keys(i, 0, tokens)[None], self.values(i, 0, tokens)[None])
                     for i in range(len(self.pool.keys)))


@dataclass(frozen=True, slots=True)
class PoolShape:
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


class BlockPool:
    def __init__(self, shape: PoolShape, budget_bytes: int, block_tokens: int, device: torch.device) -> None:
        self.shape = shape
        self.block_tokens = block_tokens
        self.num_blocks = max(0, budget_bytes // (shape.bytes_per_token * block_tokens))
        tokens = self.num_blocks * block_tokens
        # One more token than the blocks hold: the scratch slot that a CUDA graph's padding rows
        # write and read (engine/cuda_graphs.py), never part of a run.
        self.scratch_token = tokens
        # torch.empty reserves address space; pages become resident as blocks are first written.
        # A GPU pool is zeroed: no slot a padding row reads ever holds NaN bits.
        self.keys = [torch.zeros((shape.kv_heads, tokens + 1, shape.head_dim), dtype=shape.dtype, device=device)
                     if device.type == "cuda" else
                     torch.empty((shape.kv_heads, tokens + 1, shape.head_dim), dtype=shape.dtype, device=device)
                     for _ in range(shape.num_layers)]
        self.values = [torch.zeros_like(k) if device.type == "cuda" else torch.empty_like(k) for k in self.keys]
        self._refs = [0] * self.num_blocks
        self._handed_back: deque[BlockRun] = deque()  # released by another thread, for the owner to apply
        self.owner = Owner()
        self.num_used = 0

    @property
    def num_free(self) -> int:
        return self.num_blocks - self.num_used

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.block_tokens * self.shape.bytes_per_token

    @property
    def tensor_bytes(self) -> int:
        """What the pool's tensors take on the device: the blocks and the scratch token."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def allocate(self, tokens: int) -> BlockRun | None:
        """A run of consecutive free blocks holding `tokens` (first fit), with one reference; None
        when no such run is free now."""
        self.reclaim()
        need = self.blocks_for(max(tokens, 1))
        start, length = 0, 0
        for index, refs in enumerate(self._refs):
            if refs:
                start, length = index + 1, 0
                continue
            length += 1
            if length == need:
                for block in range(start, start + need):
                    self._refs[block] = 1
                self.num_used += need
                return BlockRun(self, start, need)
        return None

    def retain(self, run: BlockRun) -> None:
        self.owner.check()
        for block in run.block_ids:
            assert self._refs[block] > 0, "retain of a freed block"
            self._refs[block] += 1

    def release(self, run: BlockRun) -> None:
        self.owner.check()
        for block in run.block_ids:
            assert self._refs[block] > 0, "release of a freed block"
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self.num_used -= 1

    def release_later(self, run: BlockRun) -> None:
        """Release `run` from any thread: the owner applies it at its next use of the pool, and is
        asked to do so between its steps (so an idle engine frees the blocks too)."""
        self._handed_back.append(run)
        self.owner.soon(self.reclaim)

    def reclaim(self) -> None:
        """Apply the releases other threads handed back (the owner's thread)."""
        self.owner.check()
        while self._handed_back:
            self.release(self._handed_back.popleft())

    def refs(self, block: int) -> int:
        return self._refs[block]
