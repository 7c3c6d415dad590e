"""Small file helpers of the disk tier: deleting, fsyncing a directory, quarantined files' ages,
bad files remembered by identity, and a strictly increasing clock for LRU mtimes."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from gateway.kvcache.entry_file import FileId

_MAX_REMEMBERED_BAD = 1024


def delete(path: Path) -> bool:
    """Unlink `path`; True unless it is still there."""
    try:
        path.unlink()
    except FileNotFoundError:
        return True
    except OSError:  # read-only, immutable, or a directory under the name
        return False
    return True


def quarantined_at(path: Path) -> int:
    parts = path.name.rsplit(".", 2)  # <digest>.<kind>.<ns>.safetensors
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else 0


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory; the rename is still atomic
        fsync_file(path)


class BadFiles:
    """Bad files that could not be moved or deleted, by path and the `FileId` seen when found
    bad: the same file is skipped (no read, no second count), a rewritten one is examined again."""

    def __init__(self) -> None:
        self._seen: dict[Path, FileId] = {}
        self._lock = threading.Lock()

    def add(self, path: Path, seen: FileId) -> None:
        with self._lock:
            self._seen.pop(path, None)
            self._seen[path] = seen
            if len(self._seen) > _MAX_REMEMBERED_BAD:  # bounded: forget the oldest
                del self._seen[next(iter(self._seen))]

    def holds(self, path: Path) -> bool:
        with self._lock:
            seen = self._seen.get(path)
        if seen is None:
            return False
        try:
            return FileId.of(os.lstat(path)) == seen
        except OSError:
            return False


class Clock:
    """Strictly increasing wall-clock nanoseconds, so two touches never tie in LRU order."""

    def __init__(self) -> None:
        self._last_ns = 0
        self._lock = threading.Lock()

    def now_ns(self) -> int:
        with self._lock:
            self._last_ns = max(time.time_ns(), self._last_ns + 1)
            return self._last_ns
