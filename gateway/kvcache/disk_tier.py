"""Disk tier: prefix entries as safetensors files under `<cache_dir>/kv/`, one per key digest
(the format is in `disk_format`).

Writes are atomic (unique temp file in the same dir, fsync, rename, fsync dir), so a crash never
leaves a file that reads back as valid, and processes sharing the dir never see each other's
half-written files. A file that fails any check on read is moved to `<cache_dir>/quarantine/`
and raised as a `CacheFault`; the caller treats that as a miss. LRU under a byte budget uses file
mtimes, which a hit refreshes, so every process using the dir shares one order.
"""

from __future__ import annotations

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

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from gateway.kvcache.disk_format import (
    CacheFault,
    Header,
    check_key,
    decode,
    encode,
    identity_fields,
)
from gateway.kvcache.entry import CacheEntry
from gateway.kvcache.keys import CacheIdentity, PrefixKey

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
_DIGEST = re.compile(r"[0-9a-f]{64}")  # used with fullmatch: no trailing newline slips through
_ENTRY_NAME = re.compile(r"[0-9a-f]{64}\.safetensors")
_TEMP_PREFIX = ".tmp-"
_STALE_TEMP_S = 3600.0  # a temp file this old belongs to a writer that died
_MAX_QUARANTINED = 32
# What a damaged header or tensor table raises while being parsed.
_MALFORMED = (SafetensorError, ValueError, KeyError, TypeError, IndexError)


@dataclass(frozen=True, slots=True)
class DiskRecord:
    """What a listing shows of one file, read from its header only."""

    digest: str
    group_id: str
    tool_names: tuple[str, ...]
    num_tokens: int
    num_bytes: int
    created_at: float
    last_used_at: float
    identity: dict[str, str]  # the model, tokenizer and adapter that wrote it


@dataclass(frozen=True, slots=True)
class _FileStat:
    digest: str
    num_bytes: int
    mtime_ns: int


class DiskTier:
    """Entries on disk. `identity` is the running model's (salt ignored; the salt is in the
    digest); None gives a tier that can list and remove but not load (the CLI without a model)."""

    def __init__(self, root: Path, budget_bytes: int, identity: CacheIdentity | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.root = root
        self.kv_dir = root / "kv"
        self.quarantine_dir = root / "quarantine"
        self.budget_bytes = budget_bytes
        self.identity = identity
        self.device = torch.device(device)
        self._clock = _Clock()
        # Checks a loaded entry's tensors on all cores (a restart's first request waits for it).
        self._checkers = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="toolkv-crc")

    def close(self) -> None:
        self._checkers.shutdown(wait=False)

    # ---- entries -----------------------------------------------------------------------------

    def path_for(self, digest: str) -> Path:
        if not _DIGEST.fullmatch(digest):  # a digest is never a path: no "..", no "/"
            raise ValueError(f"not a cache key digest: {digest!r}")
        return self.kv_dir / f"{digest}{SUFFIX}"

    def can_insert(self, entry: CacheEntry) -> bool:
        return entry.num_bytes <= self.budget_bytes

    def load(self, key: PrefixKey) -> CacheEntry | None:
        """The entry for `key`, or None if there is no file. A file that fails a check is moved
        aside and raised as a CacheFault. A hit refreshes the file's LRU position."""
        if self.identity is None:
            raise RuntimeError("a DiskTier without an identity cannot load entries")
        path = self.path_for(key.digest)
        try:
            entry = self._read(path, key, self.identity)
        except FileNotFoundError:
            return None
        except CacheFault as fault:
            self._quarantine(path, fault.kind)
            raise
        self._touch(path)
        return entry

    def save(self, entry: CacheEntry) -> list[str]:
        """Write `entry` atomically (unless its file exists) and evict LRU files over the budget;
        returns the evicted digests. Raises CacheFault("write") when the disk refuses."""
        if self.identity is None:
            raise RuntimeError("a DiskTier without an identity cannot save entries")
        path = self.path_for(entry.key.digest)
        if path.exists():
            self._touch(path)
            return []
        try:
            self._write_atomically(path, entry, self.identity)
        except OSError as exc:
            raise CacheFault("write", f"cannot write {path.name}: {exc}") from exc
        except SafetensorError as exc:  # raised for I/O errors inside the serializer too
            raise CacheFault("write", f"cannot write {path.name}: {exc}") from exc
        self._touch(path)
        return self.evict_over_budget(keep=entry.key.digest)

    def remove(self, digest: str) -> bool:
        try:
            self.path_for(digest).unlink()
        except FileNotFoundError:
            return False
        return True

    def clear(self) -> int:
        """Remove every entry of this tier's model and every unreadable file (every entry when
        the tier has no identity)."""
        doomed = [s.digest for s in self._scan()
                  if self.identity is None or (r := self._record(s)) is None or self._is_ours(r)]
        return sum(self.remove(d) for d in doomed)

    def records(self) -> list[DiskRecord]:
        """Entries of this tier's model (all when it has no identity), least recently used first.
        Unreadable headers are skipped here; a lookup quarantines them."""
        records = []
        for stat in self._scan():
            record = self._record(stat)
            if record is not None and self._is_ours(record):
                records.append(record)
        return records

    def usage(self) -> tuple[int, int]:
        """(files, bytes) in the kv dir, whichever model wrote them: the budget covers them all."""
        stats = self._scan()
        return len(stats), sum(s.num_bytes for s in stats)

    def evict_over_budget(self, keep: str = "") -> list[str]:
        """Remove least recently used files until the dir fits the budget; never `keep`."""
        stats = self._scan()
        total = sum(s.num_bytes for s in stats)
        evicted: list[str] = []
        for stat in stats:
            if total <= self.budget_bytes:
                break
            if stat.digest != keep and self.remove(stat.digest):
                total -= stat.num_bytes
                evicted.append(stat.digest)
        return evicted

    def sweep_stale_temps(self, max_age_s: float = _STALE_TEMP_S) -> int:
        """Delete temp files left by writers that died mid-write."""
        cutoff, removed = time.time() - max_age_s, 0
        for path in self._temps():
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        return removed

    # ---- writing -----------------------------------------------------------------------------

    def _write_atomically(self, path: Path, entry: CacheEntry, identity: CacheIdentity) -> None:
        tensors, metadata = encode(entry, identity)
        self.kv_dir.mkdir(parents=True, exist_ok=True)
        temp = self.kv_dir / (f"{_TEMP_PREFIX}{entry.key.digest[:16]}-{os.getpid()}-"
                              f"{threading.get_ident()}-{uuid.uuid4().hex[:8]}")
        try:
            save_file(tensors, str(temp), metadata=metadata)
            _fsync_file(temp)
            os.replace(temp, path)
        finally:
            temp.unlink(missing_ok=True)
        _fsync_dir(self.kv_dir)

    def _touch(self, path: Path) -> None:
        stamp = self._clock.now_ns()
        try:
            os.utime(path, ns=(stamp, stamp))
        except OSError:  # removed meanwhile, or a read-only dir: LRU order is best effort
            pass

    # ---- reading -----------------------------------------------------------------------------

    def _read(self, path: Path, key: PrefixKey, identity: CacheIdentity) -> CacheEntry:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                header = Header.from_metadata(handle.metadata() or {})
                check_key(header, key, identity)
                tensors = {name: handle.get_tensor(name) for name in header.tensor_names}
            return decode(header, tensors, key, self.device, self._checkers.map)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise CacheFault("read", f"cannot read {path.name}: {exc}") from None
        except RuntimeError as exc:  # safe_open's "unable to open file": another process removed it
            if not path.exists():
                raise FileNotFoundError(path) from exc
            raise CacheFault("read", f"cannot read {path.name}: {exc}") from None
        except _MALFORMED as exc:
            raise CacheFault("corrupt", f"{path.name} is not a valid entry: {exc}") from None

    def _record(self, stat: _FileStat) -> DiskRecord | None:
        try:
            with safe_open(str(self.path_for(stat.digest)), framework="pt", device="cpu") as handle:
                header = Header.from_metadata(handle.metadata() or {})
        except (OSError, CacheFault, *_MALFORMED):
            return None
        return DiskRecord(stat.digest, header.group_id, header.tool_names, len(header.token_ids),
                          stat.num_bytes, header.created_at, stat.mtime_ns / 1e9, header.identity)

    def _is_ours(self, record: DiskRecord) -> bool:
        return self.identity is None or record.identity == identity_fields(self.identity)

    # ---- the directory -----------------------------------------------------------------------

    def _scan(self) -> list[_FileStat]:
        """Entry files, least recently used first (ties broken by name, so the order is total)."""
        stats = []
        for path in self._entry_paths():
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            stats.append(_FileStat(path.name[: -len(SUFFIX)], st.st_size, st.st_mtime_ns))
        return sorted(stats, key=lambda s: (s.mtime_ns, s.digest))

    def _entry_paths(self) -> Iterator[Path]:
        try:
            names = os.listdir(self.kv_dir)
        except (FileNotFoundError, NotADirectoryError):
            return
        yield from (self.kv_dir / n for n in names if _ENTRY_NAME.fullmatch(n))

    def _temps(self) -> list[Path]:
        try:
            return [self.kv_dir / n for n in os.listdir(self.kv_dir) if n.startswith(_TEMP_PREFIX)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _quarantine(self, path: Path, kind: str) -> None:
        """Move a bad file aside for inspection (or delete it), so it is never read again."""
        target = self.quarantine_dir / f"{path.stem}.{kind}.{time.time_ns()}{SUFFIX}"
        try:
            self.quarantine_dir.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
            self._trim_quarantine()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("cannot move %s to quarantine (%s); deleting it", path.name, exc)
            path.unlink(missing_ok=True)

    def _trim_quarantine(self) -> None:
        """Keep the newest few quarantined files: enough to inspect, never a growing pile."""
        moved = sorted(self.quarantine_dir.iterdir(), key=_quarantined_at)
        for old in moved[: max(0, len(moved) - _MAX_QUARANTINED)]:
            old.unlink(missing_ok=True)


# ---- helpers -----------------------------------------------------------------------------------


def _quarantined_at(path: Path) -> int:
    parts = path.name.rsplit(".", 2)  # <digest>.<kind>.<ns>.safetensors
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else 0


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems refuse fsync on a directory; the rename is still atomic
        pass


class _Clock:
    """Strictly increasing wall-clock nanoseconds, so two touches never tie in LRU order."""

    def __init__(self) -> None:
        self._last_ns = 0
        self._lock = threading.Lock()

    def now_ns(self) -> int:
        with self._lock:
            self._last_ns = max(time.time_ns(), self._last_ns + 1)
            return self._last_ns
