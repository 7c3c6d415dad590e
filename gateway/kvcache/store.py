"""The prefix store: one lookup/insert facade over the tiers. Lookup goes RAM → disk → None (the
caller computes); a disk hit is promoted to RAM. Insert puts the entry in RAM and hands the disk
write to a background thread, so the request path never waits for the disk. A disk fault is a
miss (or a skipped write) plus a counter plus a warning, never a failed request.

Entries may be pinned (never evicted by LRU pressure or the disk budget) or retained until a
deadline (a request's `prompt_cache_retention`); `pins` keeps both, on disk beside the entries
when there is a disk tier, so they survive a restart.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from gateway.kvcache.disk_format import CacheFault
from gateway.kvcache.disk_tier import DiskRecord, DiskTier
from gateway.kvcache.entry import CacheEntry
from gateway.kvcache.keys import PrefixKey
from gateway.kvcache.pins import DEFAULT_RETAINED_BUDGET_BYTES, Level, Pins
from gateway.kvcache.ram_tier import RamTier

log = logging.getLogger(__name__)

Tier = Literal["ram", "disk"]
_MAX_PENDING_WRITES = 16  # each pending write holds its entry's tensors alive


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
        self.pins.retained_budget_bytes = retained_budget_bytes
        ram.guard = self.pins.level
        self._writer = BackgroundWriter(self._persist) if disk is not None else None

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
        its file aside, and count it: the next lookup recomputes it."""
        digest = entry.key.digest
        if self._writer is not None:
            self._writer.cancel(digest)
        self.ram.remove(digest)
        if self.disk is not None:
            self.disk.quarantine(digest, kind)
        self._fault(kind, f"cache entry {digest[:16]} dropped, recomputing: {reason}")

    def lock(self, entry: CacheEntry) -> None:
        self.ram.lock(entry.key.digest)

    def unlock(self, entry: CacheEntry) -> None:
        self.ram.unlock(entry.key.digest)

    # ---- management ----------------------------------------------------------------------------

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

    # ---- pins and retention --------------------------------------------------------------------

    def pin(self, digest: str, budget_bytes: int) -> EntryInfo | None:
        """Pin the entry (None: there is none). Raises `pins.PinBudgetExceeded` when the pinned
        entries' bytes would pass `budget_bytes`."""
        info = self.find(digest)
        if info is None:
            return None
        self._forget_vanished_pins()
        self.pins.pin(digest, info.num_bytes, budget_bytes)
        return dataclasses.replace(info, pinned=True)

    def unpin(self, digest: str) -> EntryInfo | None:
        """Unpin the entry: it is evictable again (None: there is no such entry)."""
        self.pins.unpin(digest)
        return self.find(digest)

    def retain(self, digest: str, seconds: float, tenant: str = "") -> None:
        """Keep the entry of `digest` (present, or about to be computed) at least `seconds`, within
        `tenant`'s share of the retained budget (`shares.py`)."""
        self.pins.retain(digest, seconds, tenant)
        held = self.ram.peek(digest)
        if held is not None:
            self.pins.note_bytes(digest, held.num_bytes)

    def pinned_bytes(self) -> int:
        return self.pins.pinned_bytes()

    def find(self, digest: str) -> EntryInfo | None:
        return next((info for info in self.entries() if info.digest == digest), None)

    def _forget_vanished_pins(self) -> None:
        """Pins whose entry is gone from every tier (e.g. removed with `toolkv cache rm` while
        this server ran) no longer count against the budget."""
        in_ram = {e.key.digest for e in self.ram.entries()}
        gone = [d for d in self.pins.pinned() if d not in in_ram and
                (self.disk is None or not os.path.lexists(self.disk.path_for(d)))]
        if gone:
            self.pins.forget(gone)

    # ---- listing and removing ------------------------------------------------------------------

    def entries(self) -> list[EntryInfo]:
        """Every entry of this model in any tier, most recently used first, with the pins as the
        file holds them now (another process's change included)."""
        self.pins.refresh()
        merged = {e.key.digest: _ram_info(e) for e in self.ram.entries()}
        for record in self.disk.records() if self.disk is not None else ():
            held = merged.get(record.digest)
            merged[record.digest] = _disk_info(record) if held is None else _with_disk(held)
        return sorted((self._held(info) for info in merged.values()), key=lambda info: info.last_used_at,
                      reverse=True)

    def ram_entries(self) -> list[EntryInfo]:
        """The entries held in RAM, most recently used first; never touches the disk (cheap
        enough for a dashboard that polls)."""
        return [self._held(_ram_info(e)) for e in reversed(self.ram.entries())]

    def remove(self, digest: str) -> bool:
        """Drop the entry from every tier (a pending disk write of it is cancelled), and its pin."""
        if self._writer is not None:
            self._writer.cancel(digest)
        in_ram = self.ram.remove(digest)
        on_disk = self.disk.remove(digest) if self.disk is not None else False
        self.pins.forget([digest])
        return in_ram or on_disk

    def disk_digests(self) -> set[str]:
        """The entries of this model on disk (what `clear` removes there)."""
        return {record.digest for record in self.disk.records()} if self.disk is not None else set()

    def files_left(self, digests: set[str]) -> int:
        """How many of `digests`' entry files are still on disk: a removal the disk refused (a
        read-only cache dir, an immutable file) leaves them."""
        if self.disk is None:
            return 0
        return sum(os.path.lexists(self.disk.path_for(digest)) for digest in digests)

    def clear(self) -> int:
        """Drop every entry not in use, pinned ones too, and their pins; returns how many
        distinct entries went."""
        if self._writer is not None:
            self._writer.cancel_all()
        digests = {e.key.digest for e in self.ram.entries()}
        self.ram.clear()
        if self.disk is not None:
            digests.update(r.digest for r in self.disk.records())
            self.disk.clear()
        self.pins.forget(digests)
        return len(digests)

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

    def _held(self, info: EntryInfo) -> EntryInfo:
        level = self.pins.level(info.digest)
        if level is Level.NONE:
            return info
        return dataclasses.replace(info, pinned=level is Level.PINNED, retain_until=self.pins.retain_until(info.digest))

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


class BackgroundWriter:
    """Runs `write(entry)` on its own thread, oldest first, at most once per digest in flight."""

    def __init__(self, write: Callable[[CacheEntry], None], max_pending: int = _MAX_PENDING_WRITES) -> None:
        self._write = write
        self._max_pending = max_pending
        self._pending: dict[str, CacheEntry] = {}  # insertion order = write order
        self._writing: str | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="toolkv-disk-writer", daemon=True)
        self._thread.start()

    def schedule(self, entry: CacheEntry) -> bool:
        """Queue a write; False when the backlog is full or the writer is closed."""
        with self._cond:
            if self._closed or len(self._pending) >= self._max_pending:
                return False
            self._pending[entry.key.digest] = entry
            self._cond.notify_all()
            return True

    def cancel(self, digest: str) -> None:
        """Forget a pending write of `digest`, and wait out one in flight."""
        with self._cond:
            dropped = self._pending.pop(digest, None)
            self._cond.wait_for(lambda: self._writing != digest)
        if dropped is not None:
            dropped.release()

    def cancel_all(self) -> None:
        with self._cond:
            dropped = list(self._pending.values())
            self._pending.clear()
            self._cond.wait_for(lambda: self._writing is None)
        for entry in dropped:
            entry.release()

    def flush(self, timeout_s: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and self._writing is None, timeout_s)

    def close(self, timeout_s: float) -> None:
        finished = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            dropped = list(self._pending.values())
            self._pending.clear()
            for entry in dropped:
                entry.release()
            self._cond.notify_all()
        if not finished:
            log.warning("disk writes still pending after %.0fs at shutdown; dropped", timeout_s)
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while (entry := self._next()) is not None:
            try:
                self._write(entry)
            except Exception:  # the writer must outlive any one bad write
                log.exception("disk cache write failed")
            finally:
                entry.release()
                with self._cond:
                    self._writing = None
                    self._cond.notify_all()

    def _next(self) -> CacheEntry | None:
        with self._cond:
            self._cond.wait_for(lambda: self._pending or self._closed)
            if self._closed:
                return None
            digest = next(iter(self._pending))
            self._writing = digest
            return self._pending.pop(digest)


def _ram_info(entry: CacheEntry) -> EntryInfo:
    return EntryInfo(entry.key.digest, entry.group_id, entry.tool_names, entry.num_tokens,
                     entry.num_bytes, ("ram",), entry.hits, entry.created_at, entry.last_used_at)


def _disk_info(record: DiskRecord) -> EntryInfo:
    return EntryInfo(record.digest, record.group_id, record.tool_names, record.num_tokens,
                     record.kv_bytes, ("disk",), 0, record.created_at, record.last_used_at)


def _with_disk(info: EntryInfo) -> EntryInfo:
    return EntryInfo(info.digest, info.group_id, info.tool_names, info.num_tokens, info.num_bytes,
                     ("ram", "disk"), info.hits, info.created_at, info.last_used_at)
