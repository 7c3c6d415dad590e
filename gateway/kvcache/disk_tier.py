"""Disk tier: prefix entries as safetensors files under `<cache_dir>/kv/`, one per key digest
(the format is in `disk_format`).

Writes are atomic (toolkv's own locked temp file in the same dir, fsync, rename, fsync dir), so a
crash never leaves a file that reads back as valid, and processes sharing the dir never see each
other's half-written files. Temp files count against the byte budget; one no live writer holds
is swept. Entries are read through one no-follow, non-blocking fd (`entry_file`). A file that
fails any check on read is moved to `<cache_dir>/quarantine/` and raised as a `CacheFault`; the
caller treats that as a miss. A bad file that can be neither moved nor deleted is remembered in
memory (by its size, mtime and inode) and skipped until it changes. LRU under a byte budget uses
file mtimes, which a hit refreshes, so every process using the dir shares one order. Pinned
entries (`pins`, recorded in `<cache_dir>/pins.json`) are never evicted by the budget; retained
ones only when nothing unprotected is left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG

import torch

from gateway.kvcache.disk_format import (
    CacheFault,
    Header,
    check_key,
    decode,
    encode,
    identity_fields,
)
from gateway.kvcache.entry import CacheEntry, CacheIdentity, PrefixKey
from gateway.kvcache.entry_file import (
    BadFiles,
    Clock,
    FileId,
    create_locked,
    delete,
    fsync_dir,
    is_abandoned,
    open_regular,
    quarantined_at,
    read_all,
    read_metadata,
    unpack,
    write_entry,
)
from gateway.kvcache.pins import DEFAULT_RETAINED_BUDGET_BYTES, Level, Pins

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
_DIGEST = re.compile(r"[0-9a-f]{64}")  # used with fullmatch: no trailing newline slips through
_ENTRY_NAME = re.compile(r"[0-9a-f]{64}\.safetensors")
_TEMP_PREFIX = ".tmp"  # ours are `.tmp-toolkv-*`; older builds left safetensors' `.tmpXXXXXX`
_TEMP_GRACE_S = 60.0  # an unlocked temp this old belongs to a writer that died
_MAX_QUARANTINED = 32
# What a damaged header or tensor table raises while being parsed.
_MALFORMED = (ValueError, KeyError, TypeError, IndexError)


@dataclass(frozen=True, slots=True)
class DiskRecord:
    """What a listing shows of one file, read from its header only."""

    digest: str
    group_id: str
    tool_names: tuple[str, ...]
    num_tokens: int
    num_bytes: int  # the file's size
    created_at: float
    last_used_at: float
    identity: dict[str, str]  # the model, tokenizer and adapter that wrote it
    kv_bytes: int  # its keys and values: the entry's bytes in RAM (the file adds its header)


@dataclass(frozen=True, slots=True)
class _FileStat:
    digest: str
    num_bytes: int
    mtime_ns: int


class DiskTier:
    """Entries on disk. `identity` is the running model's (salt ignored; the salt is in the
    digest); None gives a tier that can list and remove but not load (the CLI without a model)."""

    def __init__(self, root: Path, budget_bytes: int, identity: CacheIdentity | None = None,
                 device: torch.device | str = "cpu",
                 retained_budget_bytes: int = DEFAULT_RETAINED_BUDGET_BYTES) -> None:
        self.root = root
        self.kv_dir = root / "kv"
        self.quarantine_dir = root / "quarantine"
        self.budget_bytes = budget_bytes
        self.identity = identity
        self.device = torch.device(device)
        self._clock = Clock()
        self._bad = BadFiles()
        self.pins = Pins(root, retained_budget_bytes)  # pinned and retained entries of every process on the dir
        # Checks a loaded entry's tensors on all cores (a restart's first request waits for it).
        self._checkers = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="toolkv-crc")

    def close(self) -> None:
        self._checkers.shutdown(wait=False)
        self.pins.close()

    # ---- entries -----------------------------------------------------------------------------

    def path_for(self, digest: str) -> Path:
        if not _DIGEST.fullmatch(digest):  # a digest is never a path: no "..", no "/"
            raise ValueError(f"not a cache key digest: {digest!r}")
        return self.kv_dir / f"{digest}{SUFFIX}"

    def can_insert(self, entry: CacheEntry) -> bool:
        return entry.num_bytes <= self.budget_bytes

    def load(self, key: PrefixKey) -> CacheEntry | None:
        """The entry for `key`, or None if there is no file (or only one already found bad). A
        file that fails a check is moved aside and raised as a CacheFault. A hit refreshes the
        file's LRU position."""
        if self.identity is None:
            raise RuntimeError("a DiskTier without an identity cannot load entries")
        path = self.path_for(key.digest)
        if self._bad.holds(path):
            return None
        try:
            entry = self._read(path, key, self.identity)
        except FileNotFoundError:
            return None
        except CacheFault as fault:
            self._quarantine(path, fault.kind)
            raise
        self._touch(path)
        return entry

    def quarantine(self, digest: str, kind: str) -> None:
        """Set aside an entry found bad in use (e.g. KV that gives non-finite logits)."""
        self._quarantine(self.path_for(digest), kind)

    def save(self, entry: CacheEntry) -> list[str]:
        """Make room for `entry` under the budget, write it atomically (unless its file exists)
        and evict LRU files still over the budget; returns the evicted digests. Raises
        CacheFault("write") when the disk refuses: the room was made first, so a full disk still
        trims to its budget (eviction never depends on a write succeeding)."""
        if self.identity is None:
            raise RuntimeError("a DiskTier without an identity cannot save entries")
        path = self.path_for(entry.key.digest)
        if os.path.lexists(path):
            if not self._bad.holds(path):  # touching a known-bad file would make it look new
                self._touch(path)
            return []
        self.sweep_stale_temps()  # another process's crash must not shrink the budget for good
        evicted = self.evict_over_budget(incoming_bytes=entry.num_bytes)
        try:
            self._write_atomically(path, entry, self.identity)
        except OSError as exc:
            raise CacheFault("write", f"cannot write {path.name}: {exc.strerror}") from exc
        self._touch(path)
        return evicted + self.evict_over_budget(keep=entry.key.digest)  # its header, beyond its KV bytes

    def remove(self, digest: str) -> bool:
        """Delete the entry's file, and any pin or retention it had."""
        removed = self._unlink(digest)
        self.pins.forget([digest])
        return removed

    def _unlink(self, digest: str) -> bool:
        path = self.path_for(digest)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:  # read-only dir, immutable file, a directory under the name
            log.warning("cannot remove cache file %s: %s", path.name, exc.strerror)
            return False
        return True

    def clear(self) -> int:
        """Remove every entry of this tier's model and every unreadable file (every entry when
        the tier has no identity)."""
        doomed = [s.digest for s in self._scan()
                  if self.identity is None or (r := self._record(s)) is None or self._is_ours(r)]
        removed = sum(self._unlink(d) for d in doomed)
        if self.identity is None:
            self.pins.forget_all()
        else:
            self.pins.forget(doomed)
        return removed

    def records(self) -> list[DiskRecord]:
        """Entries of this tier's model (all when it has no identity), least recently used first.
        Unreadable headers, truncated files and files named for another entry are skipped here
        (nothing a lookup would serve is listed, so nothing unusable is pinned); a lookup
        quarantines them."""
        records = []
        for stat in self._scan():
            record = self._record(stat)
            if record is not None and self._is_ours(record):
                records.append(record)
        return records

    def usage(self) -> tuple[int, int]:
        """(entry files, bytes) in the kv dir, whichever model wrote them, temp files' bytes
        included: the budget covers them all."""
        stats = self._scan()
        return len(stats), sum(s.num_bytes for s in stats) + self._temp_bytes() + self._quarantine_bytes()

    def evict_over_budget(self, keep: str = "", incoming_bytes: int = 0) -> list[str]:
        """Remove least recently used files until the dir (temp files included) and
        `incoming_bytes` fit the budget: unprotected ones first (a retention past its tenant's
        share protects nothing), retained ones only when none is left; never a pinned one, never
        `keep`. The files to delete are picked and deleted with no pin changing meanwhile in any
        process (`Pins.settled`)."""
        self.pins.refresh()
        stats = self._scan()
        for stat in stats:  # another process's retained entry: its file's size is what it counts
            self.pins.note_bytes(stat.digest, stat.num_bytes, if_unknown=True)
        total = sum(s.num_bytes for s in stats) + self._temp_bytes() + incoming_bytes
        # quarantined files are kept for inspection only: they give way first, the newest kept longest
        for path, num_bytes in reversed(self._quarantined()):
            if total + num_bytes <= self.budget_bytes or not delete(path):
                total += num_bytes
        if total <= self.budget_bytes:
            return []
        with self.pins.settled():
            return self._evict(stats, total, keep)

    def _evict(self, stats: list[_FileStat], total: int, keep: str) -> list[str]:
        evicted: list[str] = []
        now = time.time()
        levels = {s.digest: self.pins.level(s.digest, now) for s in stats}
        for level in (Level.NONE, Level.RETAINED):
            for stat in stats:
                if total <= self.budget_bytes:
                    return evicted
                if levels[stat.digest] is level and stat.digest != keep and self._unlink(stat.digest):
                    total -= stat.num_bytes
                    evicted.append(stat.digest)
        return evicted

    def sweep_stale_temps(self, max_age_s: float = _TEMP_GRACE_S) -> int:
        """Delete temp files left by writers that died mid-write: older than `max_age_s` and
        not locked by a live writer (in any process sharing the dir)."""
        cutoff, removed = time.time() - max_age_s, 0
        for path, _ in self._temps():
            if not is_abandoned(path, cutoff):
                continue
            try:
                path.unlink()
                removed += 1
            except OSError:  # gone meanwhile, or undeletable: it stays counted in the budget
                continue
        return removed

    # ---- writing -----------------------------------------------------------------------------

    def _write_atomically(self, path: Path, entry: CacheEntry, identity: CacheIdentity) -> None:
        """Write through a locked temp file of our own name (its lock marks it live; a crash
        leaves a name the sweep knows), fsync, rename while still holding the lock."""
        tensors, metadata = encode(entry, identity)
        self.kv_dir.mkdir(parents=True, exist_ok=True)
        temp = self.kv_dir / (f"{_TEMP_PREFIX}-toolkv-{entry.key.digest[:16]}-{os.getpid()}-"
                              f"{threading.get_ident()}-{uuid.uuid4().hex[:8]}")
        fd = create_locked(temp)
        try:
            write_entry(fd, tensors, metadata)
            os.replace(temp, path)
        finally:
            os.close(fd)
            temp.unlink(missing_ok=True)
        fsync_dir(self.kv_dir)

    def _touch(self, path: Path) -> None:
        stamp = self._clock.now_ns()
        with contextlib.suppress(OSError):  # removed meanwhile, or a read-only dir: LRU order is best effort
            os.utime(path, ns=(stamp, stamp))

    # ---- reading -----------------------------------------------------------------------------

    def _read(self, path: Path, key: PrefixKey, identity: CacheIdentity) -> CacheEntry:
        """Read from one fd on a regular file; the path is never opened a second time."""
        fd, st = open_regular(path)
        try:
            raw = read_all(fd, st.st_size)
        except OSError as exc:
            raise CacheFault("read", f"cannot read {path.name}: {exc.strerror}") from None
        finally:
            os.close(fd)
        try:
            metadata, tensors = unpack(raw)
            header = Header.from_metadata(metadata)
            check_key(header, key, identity)
            return decode(header, tensors, key, self.device, self._checkers.map)
        except _MALFORMED as exc:
            raise CacheFault("corrupt", f"{path.name} is not a valid entry: {exc}") from None

    def _record(self, stat: _FileStat) -> DiskRecord | None:
        try:
            fd, st = open_regular(self.path_for(stat.digest))
        except (OSError, CacheFault):
            return None
        try:
            header = Header.from_metadata(read_metadata(fd, st.st_size))
            kv_bytes = header.kv_bytes
        except (OSError, CacheFault, *_MALFORMED):
            return None
        finally:
            os.close(fd)
        if header.digest != stat.digest:  # another entry's file under this name: never served, never listed
            return None
        return DiskRecord(stat.digest, header.group_id, header.tool_names, len(header.token_ids),
                          stat.num_bytes, header.created_at, stat.mtime_ns / 1e9, header.identity, kv_bytes)

    def _is_ours(self, record: DiskRecord) -> bool:
        return self.identity is None or record.identity == identity_fields(self.identity)

    # ---- the directory -----------------------------------------------------------------------

    def _scan(self) -> list[_FileStat]:
        """Regular entry files (never following a symlink), least recently used first (ties
        broken by name, so the order is total)."""
        stats = [_FileStat(path.name[: -len(SUFFIX)], st.st_size, st.st_mtime_ns)
                 for path, st in self._regular_files() if _ENTRY_NAME.fullmatch(path.name)]
        return sorted(stats, key=lambda s: (s.mtime_ns, s.digest))

    def _temps(self) -> list[tuple[Path, int]]:
        """Regular temp files and their sizes."""
        return [(path, st.st_size) for path, st in self._regular_files() if path.name.startswith(_TEMP_PREFIX)]

    def _temp_bytes(self) -> int:
        return sum(num_bytes for _, num_bytes in self._temps())

    def _regular_files(self) -> Iterator[tuple[Path, os.stat_result]]:
        try:
            names = os.listdir(self.kv_dir)
        except (FileNotFoundError, NotADirectoryError):
            return
        for name in names:
            try:
                st = os.lstat(self.kv_dir / name)
            except OSError:  # removed meanwhile
                continue
            if S_ISREG(st.st_mode):
                yield self.kv_dir / name, st

    def _quarantine(self, path: Path, kind: str) -> None:
        """Move a bad file aside for inspection, or delete it, so it is never read again; when
        neither works (an immutable file, a read-only dir), remember it until it changes."""
        try:
            seen = FileId.of(os.lstat(path))
        except OSError:  # gone already
            return
        if self._move_aside(path, kind) or delete(path):
            return
        self._bad.add(path, seen)
        log.warning("cannot move or delete bad cache file %s (%s); skipping it until it changes",
                    path.name, kind)

    def _move_aside(self, path: Path, kind: str) -> bool:
        target = self.quarantine_dir / f"{path.stem}.{kind}.{time.time_ns()}{SUFFIX}"
        try:
            self.quarantine_dir.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
        except FileNotFoundError:
            return not os.path.lexists(path)
        except OSError as exc:
            log.warning("cannot move %s to quarantine (%s); deleting it", path.name, exc.strerror)
            return False
        self._trim_quarantine()
        return True

    def _quarantined(self) -> list[tuple[Path, int]]:
        """Quarantined files and their bytes, oldest first (the newest are kept longest)."""
        try:
            moved = sorted(self.quarantine_dir.iterdir(), key=quarantined_at)
        except OSError:
            return []
        found = []
        for path in moved:
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if S_ISREG(st.st_mode):
                    found.append((path, st.st_size))
        return found

    def _quarantine_bytes(self) -> int:
        return sum(num_bytes for _, num_bytes in self._quarantined())

    def _trim_quarantine(self) -> None:
        """Keep the newest few quarantined files: enough to inspect, never a growing pile."""
        moved = self._quarantined()
        for old, _ in moved[: max(0, len(moved) - _MAX_QUARANTINED)]:
            delete(old)
