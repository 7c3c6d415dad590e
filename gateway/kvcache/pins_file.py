"""The pin file, `<cache_dir>/pins.json`: its records (`Hold`), read through a no-follow,
non-blocking fd on a regular file and bounded in size; written whole through a temp file and a
rename, under an `fcntl` lock on `pins.lock` (`locked`). What the records mean, and who changes
them, is `pins.py`'s."""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import json
import logging
import os
import re
import stat
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.kvcache.disk_format import CacheFault
from gateway.kvcache.entry_file import FileId, open_regular

log = logging.getLogger(__name__)

PINS_FILE = "pins.json"
LOCK_FILE = "pins.lock"
_VERSION = 1
MAX_FILE_BYTES = 8 << 20
# `"<digest>":{"pinned":false,"bytes":<20 digits>,"retain_until":<14>,"tenant":"<16>"},` and slack
_MAX_RECORD_BYTES = 192
MAX_RECORDS = MAX_FILE_BYTES // _MAX_RECORD_BYTES  # 43,690: a full file is still read whole
_MAX_TENANT_CHARS = 64
_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(slots=True)
class Hold:
    pinned: bool = False
    num_bytes: int = 0  # the entry's bytes: against the pinned budget, or its tenant's retained share
    retain_until: float = 0.0  # wall-clock seconds; 0: no retention
    tenant: str = ""  # whose retention (`tenant_label`); "": the shared namespace

    def live(self, now: float) -> bool:
        return self.pinned or self.retain_until > now


def read_holds(path: Path) -> dict[str, Hold] | None:
    """The file's records ({} when there is none); None when it cannot be read or parsed."""
    try:
        fd, st = open_regular(path)
    except FileNotFoundError:
        return {}
    except (OSError, CacheFault) as exc:
        log.warning("cannot read %s (%s); keeping the pins known here", path.name, exc)
        return None
    try:
        if st.st_size > MAX_FILE_BYTES:
            raise ValueError(f"{st.st_size} bytes; the limit is {MAX_FILE_BYTES}")
        return _parse(json.loads(_read_fd(fd, st.st_size)))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("%s is not a valid pin file (%s); keeping the pins known here", path.name, exc)
        return None
    finally:
        os.close(fd)


def write_holds(path: Path, holds: dict[str, Hold]) -> None:
    """Write `holds` whole: a temp file of our own, fsync, rename (call under `locked`)."""
    records = {d: {"pinned": h.pinned, "bytes": h.num_bytes, "retain_until": round(h.retain_until, 3),
                   "tenant": h.tenant} for d, h in holds.items()}
    data = json.dumps({"version": _VERSION, "entries": records}, separators=(",", ":")).encode()
    temp = path.with_name(f".{PINS_FILE}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.replace(temp, path)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            temp.unlink()


def drop_expired(holds: dict[str, Hold]) -> None:
    """Drop what holds nothing any more; past MAX_RECORDS, retentions of the tenants that hold the
    most records, each its own that end first (`drop_most_held`)."""
    now = time.time()
    for digest in [d for d, h in holds.items() if not h.live(now)]:
        del holds[digest]
    drop_most_held(holds, len(holds) - MAX_RECORDS)


def drop_most_held(holds: dict[str, Hold], excess: int) -> None:
    """Drop `excess` retentions, one at a time from the tenant that holds the most records then,
    its earliest deadline first: a tenant flooding distinct retained groups pushes out its own
    records, never another tenant's few (issue 36; the deadline alone let a flood's later
    deadlines push out everyone else's). Pins are never dropped here."""
    if excess <= 0:
        return
    by_tenant: dict[str, list[tuple[float, str]]] = {}
    for digest, hold in holds.items():
        if not hold.pinned:
            by_tenant.setdefault(hold.tenant, []).append((hold.retain_until, digest))
    for held in by_tenant.values():
        held.sort(reverse=True)  # earliest deadline last: popped first
    most = [(-len(held), tenant) for tenant, held in by_tenant.items()]
    heapq.heapify(most)
    while excess > 0 and most:
        count, tenant = heapq.heappop(most)
        del holds[by_tenant[tenant].pop()[1]]
        excess -= 1
        if count + 1 < 0:
            heapq.heappush(most, (count + 1, tenant))


def file_id(path: Path) -> FileId | None:
    try:
        return FileId.of(os.stat(path, follow_symlinks=False))
    except OSError:
        return None


def _read_fd(fd: int, size: int) -> bytes:
    chunks, done = [], 0
    while done < size:
        chunk = os.pread(fd, size - done, done)
        if not chunk:
            break
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path.name} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _parse(doc: Any) -> dict[str, Hold]:
    if not isinstance(doc, dict) or doc.get("version") != _VERSION or not isinstance(doc.get("entries"), dict):
        raise ValueError("not a version-1 pin document")
    holds: dict[str, Hold] = {}
    for digest, record in list(doc["entries"].items())[:MAX_RECORDS]:
        if not _DIGEST.fullmatch(digest) or not isinstance(record, dict):
            continue
        pinned, num_bytes, until = record.get("pinned"), record.get("bytes"), record.get("retain_until")
        if not isinstance(pinned, bool) or type(num_bytes) is not int or num_bytes < 0 or \
                not isinstance(until, int | float) or isinstance(until, bool):
            continue
        tenant = record.get("tenant", "")  # absent in files older builds wrote
        if not isinstance(tenant, str) or len(tenant) > _MAX_TENANT_CHARS:
            tenant = ""
        holds[digest] = Hold(pinned, num_bytes, float(until), tenant)
    return holds
