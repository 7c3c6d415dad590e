"""Pinned and retained cache entries, by key digest. A pinned entry is never evicted by LRU
pressure (RAM tier, KV pool) nor by the disk budget; a retained one (a request's
`prompt_cache_retention: "24h"`) is not until its deadline passes. Both are kept apart from the
entry files (whose signed headers are written once) in one small JSON file beside them,
`<cache_dir>/pins.json`, so they survive a restart and every process sharing the dir sees them:

    {"version": 1, "entries": {"<digest>": {"pinned": true, "bytes": 123, "retain_until": 0.0,
                                            "tenant": "<16 hex>"}}}

Pins are an operator's: only the admin key reaches the routes that make them, and they are bounded
by `pinned_budget_bytes`. Retention is a tenant's: it protects an entry only within its tenant's
share of `retained_budget_bytes` (`shares.py`); `tenant` is a digest of the tenant's namespace,
never the salt itself.

Each change is a read-merge-write of that file (`pins_file.py`) under an exclusive lock on `pins.lock` (a change
made by another process meanwhile is kept, a removal included: a process removes what the file
holds, not only what it knew), written to a temp file and renamed. A pin or unpin the disk
refuses (a read-only or full dir) changes nothing and raises `PinsNotSaved`: a pin that would not
survive a restart, or that other processes would not see, is never reported as made. The file is read
as an entry file is, through a no-follow, non-blocking fd on a regular file; one that cannot be
read or parsed never wipes the pins this process knows: they are kept (with a warning), and the
next change writes them over it; never a failed start. The file holds at most `_MAX_RECORDS`
(retentions of the tenant holding the most records give way, its own that end first; pins are
bounded by `pinned_budget_bytes`), so a full file
is always under the size a reader takes. Another process's pin change is seen by a listing at
once (`refresh`: a stat, and a parse when the file changed) and by eviction within a second (the
same on a watcher thread, every `_REFRESH_EVERY_S`; never on the engine's thread). A retention deadline is
written in the background, and again only when it moved by an hour or more, so a request never
waits for the file. Without a directory (no disk tier) the same bookkeeping lives in memory. In
memory too, at most `_MAX_RECORDS` holds are kept (past an eighth more, the same retentions go):
a flood of distinct retained groups never grows this process, nor drops another tenant's records.
A retention this process knows that the file held and no longer holds was removed by another
process (a delete, or the record bound there): it goes here too, unless a request here renewed it
since this process last saw the file hold it (a stat every `_REFRESH_EVERY_S`), so a delete made
through one server is not written back by another (a renewal in the second before it may be: the
file keeps no tombstones).
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gateway.kvcache.entry_file import FileId
from gateway.kvcache.pins_file import (
    LOCK_FILE,
    MAX_FILE_BYTES,
    MAX_RECORDS,
    PINS_FILE,
    Hold,
    drop_expired,
    file_id,
    locked,
    read_holds,
    write_holds,
)
from gateway.kvcache.shares import Retained, protected

log = logging.getLogger(__name__)

__all__ = ["PINS_FILE", "Hold", "Level", "PinBudgetExceeded", "Pins", "PinsNotSaved", "tenant_label"]
_MAX_FILE_BYTES = MAX_FILE_BYTES  # the file's bounds, as `pins_file` sets them
_MAX_RECORDS = MAX_RECORDS
_REFRESH_EVERY_S = 1.0  # how stale another process's pin change may look to eviction here
_RESHARE_EVERY_S = 1.0  # retentions that ended give their share to the rest within this
DEFAULT_RETAINED_BUDGET_BYTES = 512 * 1024**2
_RETAIN_WRITE_SLACK_S = 3600.0  # a retention deadline is written again once it moved this much


class Level(enum.IntEnum):
    """How strongly an entry is held: eviction takes NONE first, RETAINED only when nothing else
    is left, PINNED never by LRU."""

    NONE = 0
    RETAINED = 1
    PINNED = 2


class PinBudgetExceeded(Exception):
    def __init__(self, wanted: int, pinned: int, budget: int) -> None:
        super().__init__(f"pinning {wanted} bytes would make {pinned + wanted} bytes pinned; "
                         f"pinned_budget_bytes is {budget}")
        self.wanted, self.pinned, self.budget = wanted, pinned, budget


class PinsNotSaved(Exception):
    """The pin file refused a pin or unpin (a read-only or full cache dir): nothing changed."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"the cache dir refused to record the change in {name} ({reason}); nothing changed")


Change = Callable[[dict[str, Hold]], None]


def tenant_label(namespace: str) -> str:
    """What the pin file records of a tenant: a digest of its cache namespace, never the salt."""
    return hashlib.sha256(f"toolkv-retention\0{namespace}".encode()).hexdigest()[:16] if namespace else ""


class Pins:
    def __init__(self, root: Path | None, retained_budget_bytes: int = DEFAULT_RETAINED_BUDGET_BYTES) -> None:
        self.path = root / PINS_FILE if root is not None else None
        self.retained_budget_bytes = retained_budget_bytes
        self._holds: dict[str, Hold] = {}
        self._version = 0  # bumped on every change to `_holds`: the protected set is computed again
        self._protection: tuple[int, float, set[str]] | None = None  # (version, when, protected digests)
        self._saved_until: dict[str, float] = {}  # retention deadlines as the file held them, last read or written
        self._seen_filed: dict[str, float] = {}  # the retentions the file held then, with our deadline for each
        self._seen: FileId | None = None
        self._lock = threading.Lock()  # guards the maps; held briefly, never over file work
        self._io_lock = threading.Lock()  # one read-merge-write of the file at a time
        self._flush_pending = False
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="toolkv-pins")
        self._closed = threading.Event()
        self.refresh()
        self._watcher: threading.Thread | None = None
        if self.path is not None:
            self._watcher = threading.Thread(target=self._watch, name="toolkv-pins-watch", daemon=True)
            self._watcher.start()

    # ---- reading -------------------------------------------------------------------------------

    def level(self, digest: str, now: float | None = None) -> Level:
        with self._lock:
            hold = self._holds.get(digest)
        if hold is None:
            return Level.NONE
        if hold.pinned:
            return Level.PINNED
        now = time.time() if now is None else now
        if hold.retain_until <= now:
            return Level.NONE
        with self._lock:
            return Level.RETAINED if digest in self._protected(now) else Level.NONE

    def retained(self) -> dict[str, tuple[str, int, bool]]:
        """Live retentions: digest -> (tenant, bytes, whether its tenant's share protects it)."""
        now = time.time()
        with self._lock:
            kept = self._protected(now)
            return {d: (h.tenant, h.num_bytes, d in kept) for d, h in self._holds.items()
                    if not h.pinned and h.retain_until > now}

    def _protected(self, now: float) -> set[str]:
        """The retained digests within their tenant's share (call with `_lock` held)."""
        cached = self._protection
        if cached is not None and cached[0] == self._version and 0 <= now - cached[1] < _RESHARE_EVERY_S:
            return cached[2]
        live = [Retained(d, h.tenant, h.retain_until, h.num_bytes) for d, h in self._holds.items()
                if not h.pinned and h.retain_until > now]
        kept = protected(live, self.retained_budget_bytes)
        self._protection = (self._version, now, kept)
        return kept

    def is_pinned(self, digest: str) -> bool:
        return self.level(digest) is Level.PINNED

    def retain_until(self, digest: str) -> float:
        with self._lock:
            hold = self._holds.get(digest)
        return hold.retain_until if hold is not None and hold.retain_until > time.time() else 0.0

    def pinned(self) -> dict[str, int]:
        """Pinned digests and their bytes."""
        with self._lock:
            return {d: h.num_bytes for d, h in self._holds.items() if h.pinned}

    def pinned_bytes(self) -> int:
        return sum(self.pinned().values())

    # ---- changing ------------------------------------------------------------------------------

    def pin(self, digest: str, num_bytes: int, budget: int) -> bool:
        """Pin `digest` (`num_bytes` counted against `budget`); False when it was pinned already.
        Raises PinBudgetExceeded, or PinsNotSaved when the disk refuses (nothing changed)."""
        added = False

        def change(holds: dict[str, Hold]) -> None:
            nonlocal added
            if digest in holds and holds[digest].pinned:
                return
            pinned = sum(h.num_bytes for h in holds.values() if h.pinned)
            if pinned + num_bytes > budget:
                raise PinBudgetExceeded(num_bytes, pinned, budget)
            hold = holds.setdefault(digest, Hold())
            hold.pinned, hold.num_bytes, added = True, num_bytes, True

        self._commit(change, strict=True)
        return added

    def unpin(self, digest: str) -> bool:
        """False when it was not pinned. Raises PinsNotSaved when the disk refuses (still pinned)."""
        removed = False

        def change(holds: dict[str, Hold]) -> None:
            nonlocal removed
            hold = holds.get(digest)
            if hold is not None and hold.pinned:
                hold.pinned, hold.num_bytes, removed = False, 0, True

        self._commit(change, strict=True)
        return removed

    def retain(self, digest: str, seconds: float, tenant: str = "") -> None:
        """Keep `digest` at least `seconds` from now, within the share of `tenant` (a namespace:
        recorded as its `tenant_label`). Never blocks on the file: the deadline is written in the
        background when it moved far enough."""
        now = time.time()
        until = now + seconds
        with self._lock:
            hold = self._holds.setdefault(digest, Hold())
            _charge(hold, until, tenant_label(tenant), now)
            self._version += 1
            if len(self._holds) > _MAX_RECORDS + _MAX_RECORDS // 8:  # trimmed now and then, not each time
                drop_expired(self._holds)  # down to the file's bound: the biggest holders' first
            stale = until - self._saved_until.get(digest, 0.0) >= _RETAIN_WRITE_SLACK_S
            if self.path is None or not stale or self._flush_pending:
                return
            self._flush_pending = True
        try:
            self._saver.submit(self._flush_retention)
        except RuntimeError:  # shut down
            with self._lock:
                self._flush_pending = False

    def note_bytes(self, digest: str, num_bytes: int, if_unknown: bool = False) -> None:
        """The entry's bytes, once known (a retention is often made before its entry is computed):
        what it counts against its tenant's share. `if_unknown`: only if none were noted (a file's
        size stands in for another process's entry)."""
        with self._lock:
            hold = self._holds.get(digest)
            if hold is None or hold.pinned or (if_unknown and hold.num_bytes):
                return
            if hold.num_bytes != num_bytes:
                hold.num_bytes = num_bytes
                self._version += 1

    def forget(self, digests: Iterable[str]) -> None:
        """Drop every hold on `digests` (their entries were removed), in the file too, whether or
        not this process knew of them (another process may have pinned one). A file the disk will
        not rewrite leaves them there (a warning)."""
        doomed = set(digests)
        with self._lock:
            known = doomed & self._holds.keys()
            for digest in known:
                self._holds.pop(digest, None)
            self._version += bool(known)
        if self.path is None and not known:
            return

        def change(holds: dict[str, Hold]) -> None:
            for digest in doomed:
                holds.pop(digest, None)

        self._commit(change)

    def forget_all(self) -> None:
        with self._lock:
            self._holds.clear()
            self._version += 1
        self._commit(lambda holds: holds.clear())

    def refresh(self) -> None:
        """Take in what another process wrote since we last read the file (a cheap stat when
        nothing changed)."""
        if self.path is None:
            return
        with self._io_lock:
            self._take_in(self.path)

    @contextlib.contextmanager
    def settled(self) -> Iterator[None]:
        """The pins as the file holds them, and no pin change by any process (none through this
        dir's lock) until the block ends: the disk budget picks and deletes files under it, so a
        pin another process makes meanwhile waits, and a pin made just before is seen (a refresh
        then a delete let a pin made between them lose its file). Where the lock cannot be taken
        (a read-only dir), a plain refresh."""
        if self.path is None:
            yield
            return
        with self._io_lock, contextlib.ExitStack() as stack:
            try:
                stack.enter_context(locked(self.path.parent / LOCK_FILE))
            except OSError as exc:
                log.warning("cannot lock %s (%s); trimming by the pins read last", LOCK_FILE, exc.strerror or exc)
            self._take_in(self.path)
            yield

    def _take_in(self, path: Path) -> None:
        """Read the file when it changed since we last did (call with `_io_lock` held)."""
        seen = file_id(path)
        if seen == self._seen:  # it still holds what it held: our renewals so far came before any removal
            with self._lock:
                self._seen_filed = {d: h.retain_until for d in self._seen_filed if (h := self._holds.get(d))}
            return
        on_file = read_holds(path)
        if on_file is not None:
            with self._lock:
                self._adopt(on_file)
        self._seen = seen

    def _watch(self) -> None:
        """Take in another process's changes every `_REFRESH_EVERY_S` (a stat; a parse only when
        the file changed), so eviction, which asks for levels on the engine thread and never waits
        for the disk, sees them within that, busy or idle."""
        while not self._closed.wait(_REFRESH_EVERY_S):
            try:
                self.refresh()
            except Exception:  # the watch must outlive any one bad read
                log.exception("reading %s failed", PINS_FILE)

    def close(self) -> None:
        self._closed.set()
        if self._watcher is not None:
            self._watcher.join()
        self._saver.shutdown(wait=True)

    # ---- the file ------------------------------------------------------------------------------

    def _flush_retention(self) -> None:
        with self._lock:
            self._flush_pending = False
        self._commit(lambda holds: None)

    def _commit(self, change: Change, strict: bool = False) -> None:
        """Apply `change` to the file's records (and to ours), under the lock file. The file is
        read and written outside `_lock`: eviction asking for a level never waits for the disk.
        When the disk refuses, `strict` raises PinsNotSaved with nothing changed; otherwise the
        change is kept in memory, for this process only (a warning)."""
        with self._io_lock:
            if self.path is None:
                with self._lock:
                    change(self._holds)
                    drop_expired(self._holds)
                    self._version += 1
                return
            try:
                with locked(self.path.parent / LOCK_FILE):
                    on_file = read_holds(self.path)
                    if on_file is None:
                        on_file = self._known()
                    with self._lock:
                        holds = self._merged(on_file)
                    change(holds)
                    drop_expired(holds)
                    write_holds(self.path, holds)
            except OSError as exc:  # a read-only or full dir
                if strict:
                    raise PinsNotSaved(self.path.name, exc.strerror or str(exc)) from None
                log.warning("cannot write %s (%s); retention kept in memory only", self.path.name,
                            exc.strerror or exc)
                with self._lock:
                    change(self._holds)
                    self._version += 1
                return
            with self._lock:
                self._adopt(holds)  # a retention set meanwhile is kept
            self._seen = file_id(self.path)

    def _adopt(self, on_file: dict[str, Hold]) -> None:
        """Take the file's records as ours, merged (call with `_lock` held); remember which
        retentions it held, with our deadline for each then (`_removed_elsewhere`)."""
        filed = _deadlines(on_file)
        self._replace(self._merged(on_file))
        self._saved_until = filed
        self._seen_filed = {d: self._holds[d].retain_until for d in filed if d in self._holds}

    def _replace(self, holds: dict[str, Hold]) -> None:
        """Call with `_lock` held."""
        self._holds = holds
        self._version += 1

    def _merged(self, on_file: dict[str, Hold]) -> dict[str, Hold]:
        """The file's records, with our own retention deadlines where they run longer (the file
        may lag: they are written lazily), except those the file held and another process removed
        since (`_removed_elsewhere`). Pins come from the file: every pin change writes it. Call
        with `_lock` held."""
        now = time.time()
        for digest, hold in self._holds.items():
            if hold.retain_until > now and not self._removed_elsewhere(digest, hold, on_file):
                target = on_file.setdefault(digest, Hold())
                _charge(target, hold.retain_until, hold.tenant, now)
                if not target.pinned:
                    target.num_bytes = target.num_bytes or hold.num_bytes
        return on_file

    def _removed_elsewhere(self, digest: str, hold: Hold, on_file: dict[str, Hold]) -> bool:
        """Whether the file held our retention of `digest` and another process removed it, with no
        request here renewing it since (its deadline has not moved since we saw the file hold it)."""
        was = self._seen_filed.get(digest)
        return digest not in on_file and was is not None and hold.retain_until <= was

    def _known(self) -> dict[str, Hold]:
        """A copy of this process's holds: what stands in for a file that cannot be read."""
        with self._lock:
            return {digest: Hold(h.pinned, h.num_bytes, h.retain_until, h.tenant) for digest, h in self._holds.items()}



def _charge(hold: Hold, until: float, tenant: str, now: float) -> None:
    """Retain `hold` until `until` for `tenant` (a label). A live retention stays its tenant's: a
    shared group (`shared_groups`: one digest for every key) another key retains too stays in the
    first key's share, deadline and all (another key charging itself took the group out of that
    share: its own flood then evicted the first key's retained group, issue 36). The same tenant,
    or anyone once it ended, extends it."""
    if hold.retain_until > now and hold.tenant != tenant:
        return
    if until >= hold.retain_until:
        hold.retain_until, hold.tenant = until, tenant


def _deadlines(holds: dict[str, Hold]) -> dict[str, float]:
    """The retention deadlines of `holds` (taken before our own are merged in)."""
    return {d: h.retain_until for d, h in holds.items() if h.retain_until}
