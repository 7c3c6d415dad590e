"""Entry files at the byte level, without trusting the directory they sit in: opened through one
non-blocking, no-follow fd that must be a regular file (a FIFO named like an entry would
otherwise block the reader while it holds the GIL, freezing the process), read from that fd only
(never by a path that could be swapped afterwards), and written through toolkv's own locked temp
file (a writer killed mid-write leaves a name toolkv knows, sweeps and budgets).

The container is plain safetensors (8-byte little-endian header length, JSON table with
`__metadata__`, raw tensor bytes), packed and unpacked here so that reading works on bytes and
writing streams each tensor's memory to the fd without a serialized copy.

With them, the disk tier's small file helpers: deleting, fsyncing a directory, quarantined files'
ages, bad files remembered by identity (`FileId`), and a strictly increasing clock for LRU mtimes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gateway.kvcache.disk_format import CacheFault

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_SPECIAL_ERRNOS = (errno.ELOOP, errno.ENXIO, errno.ENODEV)  # a symlink, a socket, a device
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


@dataclass(frozen=True, slots=True)
class FileId:
    """Which file a name pointed at: a rewritten or replaced file gets another id."""

    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileId:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


# ---- reading ------------------------------------------------------------------------------------


def open_regular(path: Path) -> tuple[int, os.stat_result]:
    """A read fd on `path` and its fstat. Never blocks and never follows a symlink; anything but a
    regular file is a `special` CacheFault. FileNotFoundError when there is no file."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        kind = "special" if exc.errno in _SPECIAL_ERRNOS else "read"
        raise CacheFault(kind, f"cannot open {path.name}: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CacheFault("special", f"{path.name} is not a regular file")
    return fd, st


def read_all(fd: int, num_bytes: int) -> torch.Tensor:
    """Exactly `num_bytes` from the start of `fd`, as uint8 (uninitialised memory, not a zeroed
    bytearray: the read fills it); a file that shrank meanwhile is `corrupt`."""
    buffer = torch.empty(num_bytes, dtype=torch.uint8)
    view, done = buffer.numpy().data, 0
    while done < num_bytes:
        got = os.preadv(fd, [view[done:]], done)
        if got == 0:
            raise CacheFault("corrupt", "the file shrank while it was read")
        done += got
    return buffer


def read_metadata(fd: int, num_bytes: int) -> dict[str, str]:
    """The header metadata only (a listing reads no tensor bytes). Raises ValueError if malformed,
    or if the tensors the table lists do not tile the file's data exactly (a truncated file)."""
    header_len = _header_len(os.pread(fd, 8, 0), num_bytes)
    table = _table(os.pread(fd, header_len, 8), header_len)
    position = 0
    for begin, stop, name, _, _ in sorted(_spans(table)):
        if begin != position:
            raise ValueError(f"tensor {name} does not start where the previous one ends")
        position = stop
    if position != num_bytes - 8 - header_len:
        raise ValueError(f"the table lists {position} bytes of tensors; the file holds {num_bytes - 8 - header_len}")
    return _metadata(table)


def unpack(buffer: torch.Tensor) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Metadata and tensors (views of `buffer`, no copy) of a safetensors file's bytes. Raises
    ValueError on anything malformed: lengths, JSON, dtypes, shapes, or offsets that do not tile
    the data exactly."""
    raw = buffer.numpy().data
    header_len = _header_len(bytes(raw[:8]), len(raw))
    table = _table(bytes(raw[8 : 8 + header_len]), header_len)
    metadata = _metadata(table)
    start, end = 8 + header_len, len(buffer)
    tensors: dict[str, torch.Tensor] = {}
    position = 0
    for begin, stop, name, dtype, shape in sorted(_spans(table)):
        if begin != position or stop > end - start:
            raise ValueError(f"tensor {name} does not start where the previous one ends, or overruns the file")
        tensors[name] = _view(buffer, start + begin, stop - begin, dtype, shape)
        position = stop
    if position != end - start:
        raise ValueError("the tensors do not cover the file's data exactly")
    return metadata, tensors


# ---- writing ------------------------------------------------------------------------------------


def create_locked(path: Path) -> int:
    """A new file (never an existing one, never through a symlink), exclusively locked: the lock
    tells a sweeper in any process that a live writer still owns it."""
    fd = os.open(path, _CREATE_FLAGS, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        raise
    return fd


def write_entry(fd: int, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write a safetensors file to `fd`, each tensor straight from its memory, then fsync."""
    names = sorted(tensors)
    raws = [_raw(tensors[name]) for name in names]
    table: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, raw in zip(names, raws, strict=True):
        tensor = tensors[name]
        table[name] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    header = json.dumps(table, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # tensor data starts 8-byte aligned, as safetensors does
    _write_all(fd, [len(header).to_bytes(8, "little") + header, *raws])
    os.fsync(fd)


def is_abandoned(path: Path, cutoff_s: float) -> bool:
    """True for a regular temp file last written before `cutoff_s` (epoch seconds) whose lock no
    live writer holds. The age covers the instant between a writer creating and locking it."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mtime >= cutoff_s:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # BlockingIOError: a live writer holds it
        return False
    finally:
        os.close(fd)


# ---- files: deleting, fsyncing, quarantined ages, bad files remembered, the LRU clock ------------

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


# ---- helpers ------------------------------------------------------------------------------------


def _header_len(prefix: bytes, file_bytes: int) -> int:
    if len(prefix) < 8:
        raise ValueError("the file is shorter than a safetensors header")
    header_len = int.from_bytes(prefix, "little")
    if header_len > min(file_bytes - 8, _MAX_HEADER_BYTES):
        raise ValueError("the header length points past the end of the file")
    return header_len


def _table(raw: bytes, header_len: int) -> dict[str, Any]:
    if len(raw) != header_len:
        raise ValueError("the file shrank while its header was read")
    table = json.loads(raw)
    if not isinstance(table, dict):
        raise ValueError("the header is not a JSON object")
    return table


def _metadata(table: dict[str, Any]) -> dict[str, str]:
    metadata = table.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("the header metadata is not a map of strings")
    return metadata


def _spans(table: dict[str, Any]) -> list[tuple[int, int, str, torch.dtype, list[int]]]:
    spans = []
    for name, spec in table.items():
        if name == "__metadata__":
            continue
        dtype, shape, offsets = _DTYPES[spec["dtype"]], spec["shape"], spec["data_offsets"]
        if not all(isinstance(n, int) and n >= 0 for n in [*shape, *offsets]) or len(offsets) != 2:
            raise ValueError(f"tensor {name} has a malformed shape or offsets")
        numel = 1
        for n in shape:
            numel *= n
        if offsets[1] - offsets[0] != numel * dtype.itemsize:
            raise ValueError(f"tensor {name}'s byte range does not match its shape")
        spans.append((offsets[0], offsets[1], name, dtype, shape))
    return spans


def _view(buffer: torch.Tensor, offset: int, num_bytes: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if num_bytes == 0:
        return torch.empty(shape, dtype=dtype)
    if offset % dtype.itemsize:
        raise ValueError("a tensor's data is not aligned to its dtype")
    return buffer[offset : offset + num_bytes].view(dtype).reshape(shape)


def _raw(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy when it is contiguous on the CPU (any dtype)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def _write_all(fd: int, chunks: list[bytes | memoryview]) -> None:
    for chunk in chunks:
        view, done = memoryview(chunk), 0
        while done < len(view):
            done += os.write(fd, view[done:])
