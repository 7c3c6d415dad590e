"""The disk tier against files it did not write: special files and symlinks named like entries,
bad files it can neither move nor delete, temp files of writers that died or still live."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.kvcache.block_pool import RamTier
from gateway.kvcache.disk_format import CacheFault
from gateway.kvcache.entry_file import create_locked
from gateway.kvcache.store import PrefixStore
from tests.kvcache.entries import bitwise_equal, disk, make_entry

ROOT = Path(__file__).resolve().parents[2]
TOKENS = list(range(100, 140))
HOUR_AGO_S = time.time() - 3600

_READER_OF_A_FIFO = """
import json, os, sys
from pathlib import Path
from gateway.kvcache.disk_format import CacheFault
from tests.kvcache.entries import disk, make_entry
tier, entry = disk(Path(sys.argv[1])), make_entry(list(range(100, 140)))
tier.kv_dir.mkdir(parents=True)
os.mkfifo(tier.path_for(entry.key.digest))
listed, usage = tier.records(), tier.usage()
try:
    tier.load(entry.key)
    fault = None
except CacheFault as caught:
    fault = caught.kind
print(json.dumps({"listed": len(listed), "usage": list(usage), "fault": fault,
                  "after": tier.load(entry.key) is None}))
"""


def test_a_fifo_named_like_an_entry_never_freezes_the_process(tmp_path: Path) -> None:
    """Listing, budgeting and loading it return at once (in a child process: a freeze would
    otherwise hang the test run itself); the FIFO is moved aside."""
    out = subprocess.run([sys.executable, "-c", _READER_OF_A_FIFO, str(tmp_path)], cwd=ROOT, text=True,
                         capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"listed": 0, "usage": [0, 0], "fault": "special", "after": True}
    assert [p.name.split(".")[1] for p in (tmp_path / "quarantine").iterdir()] == ["special"]


def test_a_symlink_named_like_an_entry_is_never_followed(tmp_path: Path) -> None:
    """Even to a valid entry: whoever planted the link chose what it points at."""
    entry = make_entry(TOKENS)
    elsewhere = disk(tmp_path / "elsewhere")
    elsewhere.save(entry)
    tier = disk(tmp_path / "cache")
    tier.kv_dir.mkdir(parents=True)
    tier.path_for(entry.key.digest).symlink_to(elsewhere.path_for(entry.key.digest))
    assert tier.usage() == (0, 0) and tier.records() == []  # nothing counted through the link
    with pytest.raises(CacheFault) as caught:
        tier.load(entry.key)
    assert caught.value.kind == "special" and tier.load(entry.key) is None
    assert bitwise_equal(elsewhere.load(entry.key), entry)  # type: ignore[arg-type]  # target untouched


def test_special_files_never_break_usage_eviction_or_listing(tmp_path: Path) -> None:
    entry, other = make_entry(TOKENS), make_entry(TOKENS[1:], seed=1)
    tier = disk(tmp_path, budget_bytes=1)
    tier.kv_dir.mkdir(parents=True)
    tier.path_for(other.key.digest).mkdir()  # a directory under an entry's name
    (tier.path_for(other.key.digest) / "x").write_text("keeps it non-empty")
    (tier.kv_dir / ".tmp-toolkv-dir").mkdir()
    assert tier.save(entry) == []  # over budget, but nothing else to evict: no crash on the dir
    assert tier.usage() == (1, tier.path_for(entry.key.digest).stat().st_size)
    assert [r.digest for r in tier.records()] == [entry.key.digest]
    assert tier.remove(other.key.digest) is False


@pytest.fixture
def immutable() -> Iterator[list[Path]]:
    """Paths to make immutable (chattr +i: not even root may move or delete them)."""
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed")
    paths: list[Path] = []
    yield paths
    for path in paths:
        subprocess.run(["chattr", "-i", str(path)], check=False)


def _make_immutable(path: Path, paths: list[Path]) -> None:
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("this filesystem or container refuses chattr +i")
    paths.append(path)


def test_a_bad_file_that_cannot_be_moved_or_deleted_is_a_miss_until_it_changes(
        tmp_path: Path, immutable: list[Path]) -> None:
    """Counted once, then skipped without reading it; a rewritten file is examined again."""
    entry = make_entry(TOKENS)
    store = PrefixStore(RamTier(1 << 30), disk(tmp_path))
    assert store.disk is not None
    store.disk.save(entry)
    path = store.disk.path_for(entry.key.digest)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    _make_immutable(path, immutable)
    assert store.lookup(entry.key) is None and store.lookup(entry.key) is None
    assert store.tally.drain() == {("error", "checksum"): 1}
    assert path.read_bytes() == bytes(data)  # still there, untouched
    subprocess.run(["chattr", "-i", str(path)], check=True)
    store.disk.remove(entry.key.digest)
    store.disk.save(entry)  # rewritten: a new inode, so it is read again
    found = store.lookup(entry.key)
    assert found is not None and found.tier == "disk" and bitwise_equal(found.entry, entry)
    store.close()


def test_a_temp_file_is_swept_only_when_no_live_writer_holds_it(tmp_path: Path) -> None:
    tier = disk(tmp_path)
    tier.kv_dir.mkdir(parents=True)
    held, dead = tier.kv_dir / ".tmp-toolkv-held", tier.kv_dir / ".tmpA1b2C3"  # the second: safetensors' own
    fd = create_locked(held)
    os.write(fd, b"x" * 1000)
    dead.write_bytes(b"y" * 500)
    for path in (held, dead):
        os.utime(path, (HOUR_AGO_S, HOUR_AGO_S))
    assert tier.usage() == (0, 1500)  # both count against the budget
    assert tier.sweep_stale_temps() == 1 and sorted(os.listdir(tier.kv_dir)) == [held.name]
    os.close(fd)  # the writer died: its lock went with it
    assert tier.sweep_stale_temps() == 1 and os.listdir(tier.kv_dir) == []


def test_a_fresh_unlocked_temp_file_is_left_to_its_writer(tmp_path: Path) -> None:
    """Between creating its temp file and locking it, a writer holds no lock yet."""
    tier = disk(tmp_path)
    tier.kv_dir.mkdir(parents=True)
    (tier.kv_dir / ".tmp-toolkv-new").write_bytes(b"z")
    assert tier.sweep_stale_temps() == 0 and tier.sweep_stale_temps(max_age_s=0) == 1


_FUZZ_SPECIAL_FILES = """
import os, socket, sys
from pathlib import Path
from hypothesis import HealthCheck, given, settings, strategies as st
from gateway.kvcache.block_pool import RamTier
from gateway.kvcache.store import PrefixStore
from tests.kvcache.entries import disk, make_entry

KINDS = ["fifo", "dir", "socket", "link-dev-zero", "link-loop", "link-missing", "empty", "bytes", "truncated"]
root = Path(sys.argv[1])
counter = iter(range(10**6))

@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(KINDS), junk=st.binary(max_size=4096), where=st.sampled_from(["entry", "temp"]))
def planted(kind, junk, where):
    base = root / f"run{next(counter)}"
    tier, entry = disk(base), make_entry(list(range(100, 140)))
    tier.kv_dir.mkdir(parents=True)
    target = tier.path_for(entry.key.digest) if where == "entry" else tier.kv_dir / ".tmp-toolkv-planted"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "dir":
        target.mkdir()
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        os.chdir(target.parent)  # a socket path is limited to ~100 bytes: bind the bare name
        sock.bind(target.name)
    elif kind.startswith("link"):
        target.symlink_to({"link-dev-zero": "/dev/zero", "link-loop": str(target),
                           "link-missing": str(base / "nowhere")}[kind])
    elif kind == "truncated":
        disk(base / "src").save(entry)
        whole = disk(base / "src").path_for(entry.key.digest).read_bytes()
        target.write_bytes(whole[: max(1, len(junk) % len(whole))])
    else:
        target.write_bytes(junk if kind == "bytes" else b"")
    store = PrefixStore(RamTier(1 << 30), tier)
    assert store.lookup(entry.key) is None  # a miss, never an exception or a freeze
    tier.usage(), tier.records(), tier.sweep_stale_temps()
    tier.save(entry)  # and the real entry can still be written and read back
    assert store.lookup(entry.key) is not None or where == "entry" and kind in ("dir",)

planted()
print("ok")
"""


def test_fuzzed_special_and_junk_files_are_misses_never_errors_or_freezes(tmp_path: Path) -> None:
    """Hypothesis plants FIFOs, sockets, directories, symlinks (to /dev/zero, to themselves, to
    nothing), junk and truncated entries under an entry's name or a temp name: every lookup is a
    miss, never an exception or a freeze (in a child process, so a freeze fails the test)."""
    out = subprocess.run([sys.executable, "-c", _FUZZ_SPECIAL_FILES, str(tmp_path)], cwd=ROOT, text=True,
                         capture_output=True, timeout=300, env={**os.environ, "HYPOTHESIS_NO_PLUGINS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


@pytest.mark.parametrize("layer", [{"dtype": "nn", "keys_shape": [1], "values_shape": [1]},
                                   {"dtype": "float32", "keys_shape": ["9" * 5000], "values_shape": [1]},
                                   {"dtype": "float32", "keys_shape": [-4], "values_shape": [1]}, "float32"])
def test_an_entry_whose_header_names_impossible_layers_is_left_out_of_the_listing(tmp_path: Path, layer) -> None:
    """A listing reads headers before verifying them: one whose layers have no size (an unknown
    dtype, a shape that is no number) is skipped like any unreadable file, never a failed listing."""
    from gateway.kvcache.disk_format import encode
    from gateway.kvcache.entry_file import write_entry
    from tests.kvcache.entries import IDENTITY

    tier = disk(tmp_path)
    good, bad = make_entry(list(range(16))), make_entry(list(range(100, 116)), seed=1)
    tier.save(good)
    tensors, metadata = encode(bad, IDENTITY)
    metadata = {k: (json.dumps([layer]) if k.endswith("layers") else v) for k, v in metadata.items()}
    fd = create_locked(tier.path_for(bad.key.digest))
    try:
        write_entry(fd, tensors, metadata)
    finally:
        os.close(fd)
    store = PrefixStore(RamTier(1 << 30), tier)
    try:
        assert [r.digest for r in tier.records()] == [good.key.digest]
        assert [(i.digest, i.num_bytes) for i in store.entries()] == [(good.key.digest, good.num_bytes)]
    finally:
        store.close()
