"""RAM tier: LRU under a byte budget. An entry that is locked (in use by a request) is never evicted.
An entry kept here holds a reference to its KV pool blocks; removing it gives them back.

`guard(digest)` says how strongly an entry is held (`pins.Level`): LRU eviction takes unprotected
entries only; a retained entry (within its tenant's share of the retained budget: past it, a
retention protects nothing) goes only to make room for a pinned one, or when the pool asks for
more (`evict_oldest(up_to=...)`); a pinned one only when the pool asks for it explicitly.

Owned by the engine's thread (`block_pool.py`'s `Owner`): every change, a match's LRU move included, is checked
to come from it, so the tier needs no lock. Other threads see it through the engine's stats
snapshot (engine/stats.py) or ask the engine (`engine.call`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gateway.kvcache.block_pool import Owner
from gateway.kvcache.entry import CacheEntry, PrefixKey
from gateway.kvcache.pins import Level


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
