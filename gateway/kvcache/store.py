"""The prefix store: one lookup/insert facade over the tiers. Lookup goes RAM → disk → None (the
caller computes); a disk hit is promoted to RAM. Insert puts the entry in RAM and hands the disk
write to a background thread, so the request path never waits for the disk. A disk fault is a
miss (or a skipped write) plus a counter plus a warning, never a failed request.

Entries may be pinned (never evicted by LRU pressure or the disk budget) or retained until a
deadline (a request's `prompt_cache_retention`); `pins` keeps both, on disk beside the entries
when there is a disk tier, so they survive a restart.

Who may call what: the engine's thread owns the in-memory state (the RAM tier's entries, LRU order
and in-use counts, and through them the KV pool's block references: `block_pool.py`'s `Owner` checks it), so
the methods under "engine thread" run there (or where no engine runs: start-up, the CLI, tests).
The disk tier and the pins are shared anyway, with the disk writer thread, the pins watcher and
the other processes on the cache dir, and keep their own locks; the methods under "any thread"
touch only them and never block the engine. A route's change is one of each in turn: the RAM part
through `engine.call`, then the disk part on the route's worker thread (serving/store_admin.py).
The whole-store methods (`entries`, `pin`, `remove`, `clear`, ...) are the same two parts on one
thread, for a caller that owns the store.

Locks (six, down from eight: the RAM tier's and the block pool's went when the engine became
their only user), each at a real thread boundary:
- `Tally`: counted on the engine and disk writer threads, drained by the metrics collector;
- `BackgroundWriter`'s condition: the queue between the engine and the disk writer thread;
- `Pins`: its maps (`_lock`) and its file's read-merge-write (`_io_lock`), shared by the engine
  (eviction asks for levels), the pins watcher and saver threads and the routes' worker threads;
- the disk tier's `BadFiles` and `Clock` (entry_file.py): used by the engine's reads, the disk
  writer's saves and the routes' listings.
The block pool's hand-back queue (`BlockPool.release_later`) is a thread-safe deque, not a lock.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Literal

from gateway.kvcache.block_pool import Owner, RamTier
from gateway.kvcache.disk_format import CacheFault
from gateway.kvcache.disk_tier import DiskRecord, DiskTier
from gateway.kvcache.disk_writer import BackgroundWriter
from gateway.kvcache.entry import CacheEntry, PrefixKey
from gateway.kvcache.pins import DEFAULT_RETAINED_BUDGET_BYTES, Level, Pins

log = logging.getLogger(__name__)

Tier = Literal["ram", "disk"]
# Retention protects at most this fraction of the KV pool, whatever retained_budget_bytes says: with
# a budget the size of the pool, one key's retentions (the only key asking) held every block, and
# every other key's group missed (issue 36). The rest of the pool is plain LRU for everyone.
RETAINED_POOL_FRACTION = 2


@dataclass(frozen=True, slots=True)
class Found:
    entry: CacheEntry
    tier: Tier


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """One entry as a listing shows it, whichever tiers hold it."""

    digest: str
    group_id: str
    tool_names: tuple[str, ...]
    num_tokens: int
    num_bytes: int  # its keys' and values' bytes: the same in every tier (a file adds its header)
    tiers: tuple[Tier, ...]  # fastest first
    hits: int
    created_at: float
    last_used_at: float
    pinned: bool = False
    retain_until: float = 0.0  # a request's retention deadline (wall clock); 0: none


class Tally:
    """Thread-safe event counts (evictions per tier, faults per kind), drained by the metrics
    collector."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def add(self, event: str, label: str, count: int = 1) -> None:
        if count:
            with self._lock:
                self._counts[(event, label)] += count

    def drain(self) -> dict[tuple[str, str], int]:
        with self._lock:
            taken = dict(self._counts)
            self._counts.clear()
            return taken


class PrefixStore:
    def __init__(self, ram: RamTier, disk: DiskTier | None = None,
                 retained_budget_bytes: int = DEFAULT_RETAINED_BUDGET_BYTES) -> None:
        self.ram = ram
        self.disk = disk
        self.tally = Tally()
        self.pins = disk.pins if disk is not None else Pins(None)
        self.pins.retained_budget_bytes = min(retained_budget_bytes, ram.budget_bytes // RETAINED_POOL_FRACTION)
        if self.pins.retained_budget_bytes < retained_budget_bytes:
            log.info("retention keeps at most %d bytes, 1/%d of the KV pool (retained_budget_bytes is %d)",
                     self.pins.retained_budget_bytes, RETAINED_POOL_FRACTION, retained_budget_bytes)
        ram.guard = self.pins.level
        self.owner = ram.owner = Owner()  # the engine binds it to its thread (Engine.__init__)
        self._writer = BackgroundWriter(self._persist) if disk is not None else None

    # ---- engine thread: lookups and inserts ----------------------------------------------------

    def lookup(self, key: PrefixKey) -> Found | None:
        entry = self.ram.match(key)
        if entry is not None:
            return Found(entry, "ram")
        entry = self._load_from_disk(key)
        if entry is None:
            return None
        self._insert_ram(entry)
        return Found(entry, "disk")

    def insert(self, entry: CacheEntry) -> None:
        """Keep `entry` in RAM now; write it to disk in the background."""
        self._insert_ram(entry)
        if self._writer is None or self.disk is None or not self.disk.can_insert(entry):
            return
        entry.retain()  # a pending write reads the entry's blocks: keep them until it is done
        entry.mark_computed()  # the write copies them off the GPU after this, beside the engine's steps
        if not self._writer.schedule(entry):
            entry.release()
            self._fault("backlog", f"disk write of {entry.group_id} dropped: writer backlog full")

    def keep_in_ram(self, entry: CacheEntry) -> None:
        """Keep `entry` in RAM (replacing an entry of the same key), without a disk write."""
        self._insert_ram(entry)

    def quarantine(self, entry: CacheEntry, kind: str, reason: str) -> None:
        """Drop an entry found bad in use (its KV gave non-finite logits) from every tier, set
        its file aside, and count it: the next lookup recomputes it. Rare: it waits out a write
        of the entry in flight, so that the file set aside is the last one."""
        digest = entry.key.digest
        if self._writer is not None:
            self._writer.cancel(digest)
            self._writer.wait_out(digest)
        self.ram.remove(digest)
        if self.disk is not None:
            self.disk.quarantine(digest, kind)
        self._fault(kind, f"cache entry {digest[:16]} dropped, recomputing: {reason}")

    def lock(self, entry: CacheEntry) -> None:
        self.ram.lock(entry.key.digest)

    def unlock(self, entry: CacheEntry) -> None:
        self.ram.unlock(entry.key.digest)

    # ---- engine thread: eviction, removal, retention -------------------------------------------

    def evict_oldest(self, up_to: Level = Level.NONE) -> bool:
        """Drop the least recently used RAM entry not in use, to give its blocks back to the
        pool (it stays on disk, and keeps its pin or retention there); unprotected entries only,
        unless `up_to` lets retained (then pinned) ones go when none is left. False when there
        is none."""
        evicted = self.ram.evict_oldest(up_to)
        if evicted is None:
            return False
        if evicted.level is not Level.NONE:
            log.warning("the KV pool had nothing else to evict: dropped %s entry %s from RAM (it stays on "
                        "disk); pinned_budget_bytes may be too close to ram_budget_bytes",
                        evicted.level.name.lower(), evicted.digest[:16])
        self.tally.add("eviction", "ram")
        return True

    def drop_from_ram(self, digest: str) -> bool:
        """Drop the entry from RAM and cancel its pending disk write (one in flight finishes:
        `drop_from_disk` waits it out); whether RAM held it."""
        if self._writer is not None:
            self._writer.cancel(digest)
        return self.ram.remove(digest)

    def clear_ram(self) -> set[str]:
        """Drop every RAM entry not in use and cancel every pending disk write; their digests."""
        if self._writer is not None:
            self._writer.cancel_all()
        return set(self.ram.clear())

    def retain(self, digest: str, seconds: float, tenant: str = "") -> None:
        """Keep the entry of `digest` (present, or about to be computed) at least `seconds`, within
        `tenant`'s share of the retained budget (`shares.py`)."""
        self.pins.retain(digest, seconds, tenant)
        held = self.ram.peek(digest)
        if held is not None:
            self.pins.note_bytes(digest, held.num_bytes)

    def ram_entries(self) -> list[EntryInfo]:
        """The entries held in RAM, most recently used first; never touches the disk (what the
        engine's stats snapshot lists)."""
        return [self._held(_ram_info(e)) for e in reversed(self.ram.entries())]

    # ---- any thread: the disk and the pins, given the RAM listing ------------------------------

    def entries_with(self, ram: list[EntryInfo]) -> list[EntryInfo]:
        """Every entry of this model in any tier (`ram`: the RAM tier's, from `ram_entries`), most
        recently used first, with the pins as the file holds them now (another process's change
        included)."""
        self.pins.refresh()
        merged = {info.digest: info for info in ram}
        for record in self.disk.records() if self.disk is not None else ():
            held = merged.get(record.digest)
            merged[record.digest] = _disk_info(record) if held is None else _with_disk(held)
        return sorted((self._held(info) for info in merged.values()), key=lambda info: info.last_used_at,
                      reverse=True)

    def find_with(self, ram: list[EntryInfo], digest: str) -> EntryInfo | None:
        return next((info for info in self.entries_with(ram) if info.digest == digest), None)

    def pin_with(self, ram: list[EntryInfo], digest: str, budget_bytes: int) -> EntryInfo | None:
        """Pin the entry (None: there is none). Raises `pins.PinBudgetExceeded` when the pinned
        entries' bytes would pass `budget_bytes`."""
        info = self.find_with(ram, digest)
        if info is None:
            return None
        self._forget_vanished_pins({i.digest for i in ram})
        self.pins.pin(digest, info.num_bytes, budget_bytes)
        return dataclasses.replace(info, pinned=True)

    def unpin_with(self, ram: list[EntryInfo], digest: str) -> EntryInfo | None:
        """Unpin the entry: it is evictable again (None: there is no such entry)."""
        self.pins.unpin(digest)
        return self.find_with(ram, digest)

    def drop_from_disk(self, digest: str) -> bool:
        """After `drop_from_ram`: wait out a write of the entry in flight, then drop its file and
        its pin; whether a file went."""
        if self._writer is not None:
            self._writer.wait_out(digest)
        on_disk = self.disk.remove(digest) if self.disk is not None else False
        self.pins.forget([digest])
        return on_disk

    def clear_disk(self, dropped: set[str]) -> int:
        """After `clear_ram` (which gave `dropped`): wait out the write in flight, drop every file
        and the pins of all of them; how many distinct entries went."""
        digests = set(dropped)
        if self._writer is not None:
            self._writer.wait_idle()
        if self.disk is not None:
            digests.update(r.digest for r in self.disk.records())
            self.disk.clear()
        self.pins.forget(digests)
        return len(digests)

    def pinned_bytes(self) -> int:
        return self.pins.pinned_bytes()

    def disk_digests(self) -> set[str]:
        """The entries of this model on disk (what `clear` removes there)."""
        return {record.digest for record in self.disk.records()} if self.disk is not None else set()

    def files_left(self, digests: set[str]) -> int:
        """How many of `digests`' entry files are still on disk: a removal the disk refused (a
        read-only cache dir, an immutable file) leaves them."""
        if self.disk is None:
            return 0
        return sum(os.path.lexists(self.disk.path_for(digest)) for digest in digests)

    # ---- the whole store, for a caller that owns it (no engine runs, or on its thread) ---------

    def entries(self) -> list[EntryInfo]:
        return self.entries_with(self.ram_entries())

    def find(self, digest: str) -> EntryInfo | None:
        return self.find_with(self.ram_entries(), digest)

    def pin(self, digest: str, budget_bytes: int) -> EntryInfo | None:
        return self.pin_with(self.ram_entries(), digest, budget_bytes)

    def unpin(self, digest: str) -> EntryInfo | None:
        return self.unpin_with(self.ram_entries(), digest)

    def remove(self, digest: str) -> bool:
        """Drop the entry from every tier (a pending disk write of it is cancelled), and its pin."""
        in_ram = self.drop_from_ram(digest)
        return self.drop_from_disk(digest) or in_ram

    def clear(self) -> int:
        """Drop every entry not in use, pinned ones too, and their pins; returns how many
        distinct entries went."""
        return self.clear_disk(self.clear_ram())

    # ---- any thread: the disk writer -----------------------------------------------------------

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every scheduled disk write is done; False on timeout."""
        return self._writer.flush(timeout_s) if self._writer is not None else True

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish pending disk writes (up to `timeout_s`) and stop the writer thread."""
        if self._writer is not None:
            self._writer.close(timeout_s)
        if self.disk is not None:
            self.disk.close()

    # ---- internals -----------------------------------------------------------------------------

    def _forget_vanished_pins(self, in_ram: set[str]) -> None:
        """Pins whose entry is gone from every tier (e.g. removed with `toolkv cache rm` while
        this server ran) no longer count against the budget."""
        gone = [d for d in self.pins.pinned() if d not in in_ram and
                (self.disk is None or not os.path.lexists(self.disk.path_for(d)))]
        if gone:
            self.pins.forget(gone)

    def _held(self, info: EntryInfo) -> EntryInfo:
        """`info` with its pin and retention as they are now (a RAM listing may be older)."""
        level = self.pins.level(info.digest)
        pinned = level is Level.PINNED
        until = 0.0 if level is Level.NONE else self.pins.retain_until(info.digest)
        if info.pinned == pinned and info.retain_until == until:
            return info
        return dataclasses.replace(info, pinned=pinned, retain_until=until)

    def _insert_ram(self, entry: CacheEntry) -> None:
        self.pins.note_bytes(entry.key.digest, entry.num_bytes)  # before it competes for room
        self.tally.add("eviction", "ram", len(self.ram.insert(entry)))

    def _load_from_disk(self, key: PrefixKey) -> CacheEntry | None:
        if self.disk is None:
            return None
        try:
            return self.disk.load(key)
        except CacheFault as fault:
            self._fault(fault.kind, f"disk cache entry rejected, recomputing: {fault}")
            return None
        except OSError as exc:  # whatever the filesystem raises, the lookup is a miss
            self._fault("read", f"disk cache lookup failed, recomputing: {exc.strerror}")
            return None

    def _persist(self, entry: CacheEntry) -> None:
        assert self.disk is not None
        try:
            evicted = self.disk.save(entry)
        except CacheFault as fault:
            self._fault(fault.kind, f"disk cache write failed, entry kept in RAM only: {fault}")
            return
        except Exception as exc:  # whatever the serializer raises, the write failed
            self._fault("write", f"disk cache write failed, entry kept in RAM only: {exc!r}")
            return
        self.tally.add("eviction", "disk", len(evicted))

    def _fault(self, kind: str, message: str) -> None:
        self.tally.add("error", kind)
        log.warning("%s", message)


def _ram_info(entry: CacheEntry) -> EntryInfo:
    return EntryInfo(entry.key.digest, entry.group_id, entry.tool_names, entry.num_tokens,
                     entry.num_bytes, ("ram",), entry.hits, entry.created_at, entry.last_used_at)


def _disk_info(record: DiskRecord) -> EntryInfo:
    return EntryInfo(record.digest, record.group_id, record.tool_names, record.num_tokens,
                     record.kv_bytes, ("disk",), 0, record.created_at, record.last_used_at)


def _with_disk(info: EntryInfo) -> EntryInfo:
    return EntryInfo(info.digest, info.group_id, info.tool_names, info.num_tokens, info.num_bytes,
                     ("ram", "disk"), info.hits, info.created_at, info.last_used_at)
