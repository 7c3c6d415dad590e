"""The KV block pool: every key and value the engine computes lives here, preallocated once per
layer from `ram_budget_bytes`, so memory is bounded by the pool and not by traffic; and the RAM
tier, the cached prefixes among those blocks (as vLLM's `BlockPool` keeps its cached blocks).

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

The RAM tier (`RamTier`, below): LRU under a byte budget. An entry that is locked (in use by a
request) is never evicted. An entry kept there holds a reference to its KV pool blocks; removing
it gives them back.

`guard(digest)` says how strongly an entry is held (`pins.Level`): LRU eviction takes unprotected
entries only; a retained entry (within its tenant's share of the retained budget: past it, a
retention protects nothing) goes only to make room for a pinned one, or when the pool asks for
more (`evict_oldest(up_to=...)`); a pinned one only when the pool asks for it explicitly.

Owned by the engine's thread (`Owner`): every change, a match's LRU move included, is checked to
come from it. Other threads see it through the engine's stats snapshot (engine/stats.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gateway.kvcache.entry import CacheEntry, LayerKV, PrefixKey
from gateway.kvcache.pins import Level

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


# ---- the RAM tier -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Eviction:
    digest: str
    num_bytes: int
    level: Level = Level.NONE


def _unguarded(digest: str) -> Level:
    return Level.NONE


class RamTier:
    def __init__(self, budget_bytes: int, guard: Callable[[str], Level] = _unguarded) -> None:
        self.budget_bytes = budget_bytes
        self.guard = guard
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()  # oldest first
        self._locks: dict[str, int] = {}
        self.owner = Owner()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, key: PrefixKey) -> CacheEntry | None:
        """The entry for `key`, marked most recently used; None if absent or not an exact match."""
        self.owner.check()
        entry = self._entries.get(key.digest)
        if entry is None or not entry.matches(key):
            return None
        self._entries.move_to_end(key.digest)
        return entry

    def peek(self, digest: str) -> CacheEntry | None:
        """The entry kept under `digest`, without marking it used."""
        return self._entries.get(digest)

    def holds(self, entry: CacheEntry) -> bool:
        """Whether this very entry is kept here (without marking it used)."""
        return self._entries.get(entry.key.digest) is entry

    def can_insert(self, entry: CacheEntry) -> bool:
        return entry.num_bytes <= self.budget_bytes

    def insert(self, entry: CacheEntry) -> list[Eviction]:
        """Store `entry` as most recently used, evicting unlocked LRU entries to fit the budget."""
        self.owner.check()
        if not self.can_insert(entry):
            return []
        entry.retain()  # the tier's own reference to the entry's pool blocks (taken first: the
        self._remove(entry.key.digest)  # entry may be the one it replaces)
        # an unprotected or retained entry makes room among unprotected ones; a pinned one
        # among retained ones too
        below = max(self.guard(entry.key.digest), Level.RETAINED)
        evicted = self._evict_for(entry.num_bytes, below)
        if self.num_bytes + entry.num_bytes > self.budget_bytes:
            entry.release()
            return evicted  # the rest is locked or protected; the entry is used once, not kept
        self._entries[entry.key.digest] = entry
        self.num_bytes += entry.num_bytes
        return evicted

    def lock(self, digest: str) -> None:
        self.owner.check()
        self._locks[digest] = self._locks.get(digest, 0) + 1

    def in_use(self, digest: str) -> bool:
        """Whether a running sequence holds the entry (locked: it is never evicted)."""
        return digest in self._locks

    def unlock(self, digest: str) -> None:
        self.owner.check()
        count = self._locks.get(digest, 0) - 1
        if count > 0:
            self._locks[digest] = count
        else:
            self._locks.pop(digest, None)

    def remove(self, digest: str) -> bool:
        self.owner.check()
        return self._remove(digest)

    def clear(self) -> list[str]:
        """Drop every entry not in use; returns their digests."""
        self.owner.check()
        digests = [d for d in self._entries if d not in self._locks]
        for digest in digests:
            self._remove(digest)
        return digests

    def entries(self) -> list[CacheEntry]:
        """Entries, least recently used first (the owner's view: others read the stats snapshot)."""
        return list(self._entries.values())

    def evict_oldest(self, up_to: Level = Level.NONE) -> Eviction | None:
        """Drop the least recently used entry not in use (the pool needs its blocks), of the
        lowest protection level there is, up to `up_to`."""
        self.owner.check()
        found: tuple[Level, str] | None = None
        for digest in self._entries:  # least recently used first
            if digest in self._locks:
                continue
            level = self.guard(digest)
            if level <= up_to and (found is None or level < found[0]):
                found = (level, digest)
                if level is Level.NONE:
                    break
        if found is None:
            return None
        level, digest = found
        evicted = Eviction(digest, self._entries[digest].num_bytes, level)
        self._remove(digest)
        return evicted

    def _levels(self) -> dict[str, Level]:
        """The protection level of every entry not in use, least recently used first."""
        return {d: self.guard(d) for d in self._entries if d not in self._locks}

    def _evict_for(self, incoming_bytes: int, below: Level) -> list[Eviction]:
        evicted: list[Eviction] = []
        levels = self._levels()
        for level in sorted(set(levels.values())):
            if level >= below:
                break
            for digest in [d for d, held in levels.items() if held == level]:
                if self.num_bytes + incoming_bytes <= self.budget_bytes:
                    return evicted
                evicted.append(Eviction(digest, self._entries[digest].num_bytes, level))
                self._remove(digest)
        return evicted

    def _remove(self, digest: str) -> bool:
        entry = self._entries.pop(digest, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        entry.release()
        return True
