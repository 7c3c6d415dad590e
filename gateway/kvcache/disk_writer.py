"""The disk writer: one background thread that writes cache entries to the disk tier, oldest
first, at most one write per digest in flight, so the request path never waits for the disk.

A pending write holds a reference to its entry's pool blocks (taken on the engine's thread when
it is scheduled) and hands it back when done or dropped (`CacheEntry.release_later`): the block
counts change on the engine's thread only (block_pool.py's `Owner`). The condition guards the queue between the
engine's thread, which schedules and cancels, and the writer's; `wait_out` and `wait_idle` are for
the threads that remove files (a route's worker thread), never the engine's in the common path."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gateway.kvcache.entry import CacheEntry

log = logging.getLogger(__name__)

_MAX_PENDING_WRITES = 16  # each pending write holds its entry's tensors alive


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
        """Forget a pending write of `digest` (one in flight finishes: `wait_out`)."""
        with self._cond:
            dropped = self._pending.pop(digest, None)
        if dropped is not None:
            dropped.release_later()

    def cancel_all(self) -> None:
        """Forget every pending write (one in flight finishes: `wait_idle`)."""
        with self._cond:
            dropped = list(self._pending.values())
            self._pending.clear()
        for entry in dropped:
            entry.release_later()

    def wait_out(self, digest: str) -> None:
        """Wait until no write of `digest` is in flight."""
        with self._cond:
            self._cond.wait_for(lambda: self._writing != digest)

    def wait_idle(self) -> None:
        """Wait until no write is in flight."""
        with self._cond:
            self._cond.wait_for(lambda: self._writing is None)

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
                entry.release_later()
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
                entry.release_later()  # the engine's thread owns the pool's counts
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
