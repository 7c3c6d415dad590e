"""Pins across processes on one cache dir (issue 36): a removal in one process unpins what another
pinned (it merges with the file, not with what it knew); another process's pin is listed at once;
a pin or unpin the dir refuses (read-only, full) raises and changes nothing; a full disk still
trims to its budget. Real processes (`python -c`) beside this one, as test_disk_processes does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gateway.kvcache.block_pool import RamTier
from gateway.kvcache.pins import PINS_FILE, Level, Pins, PinsNotSaved
from gateway.kvcache.pins_file import LOCK_FILE, Hold, locked, write_holds
from gateway.kvcache.store import PrefixStore
from tests.kvcache.entries import disk, make_entry

ROOT = Path(__file__).resolve().parents[2]

# A second process holding entry X on the dir: pins it when told, then reports what it counts.
_HOLDER = """
import json, sys
from pathlib import Path
from gateway.kvcache.block_pool import RamTier
from gateway.kvcache.store import PrefixStore
from tests.kvcache.entries import disk, make_entry
store = PrefixStore(RamTier(1 << 30), disk(Path(sys.argv[1])))
entry = make_entry(list(range(16)))
store.insert(entry)
assert store.flush(30)
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "pin":
        store.pin(entry.key.digest, budget_bytes=1 << 30)
        print("pinned", flush=True)
    else:
        listed = {info.digest: info.pinned for info in store.entries()}
        print(json.dumps({"pinned_bytes": store.pinned_bytes(), "listed": listed}), flush=True)
store.close()
"""

# A process on a full disk (no file may grow): a pin is refused; a save still trims the dir.
_ON_A_FULL_DISK = """
import json, resource, signal, sys
from pathlib import Path
from gateway.kvcache.disk_format import CacheFault
from gateway.kvcache.disk_tier import DiskTier
from gateway.kvcache.pins import PinsNotSaved
from tests.kvcache.entries import IDENTITY, make_entry
root, budget = Path(sys.argv[1]), int(sys.argv[2])
tier = DiskTier(root, budget, IDENTITY)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, as ENOSPC, rather than a killed process
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
result = {}
try:
    tier.pins.pin("a" * 64, 100, budget=1 << 30)
    result["pin"] = "made"
except PinsNotSaved as exc:
    result["pin"] = str(exc)
try:
    tier.save(make_entry([4242] * 16, seed=42))
    result["save"] = "written"
except CacheFault as exc:
    result["save"] = exc.kind
result["usage"] = tier.usage()[1]
result["pinned"] = tier.pins.level("a" * 64).name
print(json.dumps(result))
"""


@contextmanager
def _holder(root: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root)], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.stderr
        yield proc
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=30)


def _ask(proc: subprocess.Popen[str], line: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def test_a_delete_in_one_process_unpins_what_another_pinned(tmp_path: Path) -> None:
    """Server 2's DELETE answered deleted: true and left the entry pinned in pins.json: it had not
    read the file since server 1 pinned, and only dropped the holds it knew."""
    digest = make_entry(list(range(16))).key.digest
    here = PrefixStore(RamTier(1 << 30), disk(tmp_path))
    try:
        with _holder(tmp_path) as other:
            assert here.pins.level(digest) is Level.NONE  # read before the other process pins
            assert _ask(other, "pin") == "pinned"
            assert here.remove(digest) is True
            assert digest not in json.loads((tmp_path / PINS_FILE).read_text())["entries"]
            seen = json.loads(_ask(other, "count"))
            assert seen == {"pinned_bytes": 0, "listed": {digest: False}}  # its RAM copy, no longer pinned
    finally:
        here.close()


def test_a_pin_made_in_another_process_is_listed_at_once(tmp_path: Path) -> None:
    here = PrefixStore(RamTier(1 << 30), disk(tmp_path))
    try:
        with _holder(tmp_path) as other:
            digest = make_entry(list(range(16))).key.digest
            assert [info.pinned for info in here.entries()] == [False]
            assert _ask(other, "pin") == "pinned"
            assert [info.pinned for info in here.entries()] == [True]  # no wait: a listing reads the file
            assert here.pinned_bytes() == make_entry(list(range(16))).num_bytes
            assert json.loads(_ask(other, "count"))["listed"] == {digest: True}
    finally:
        here.close()


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A cache dir nothing may be created in or renamed into, root included (chattr +i: plain
    permissions do not stop root, and tests may run as root)."""
    root = tmp_path / "cache"
    root.mkdir()
    Pins(root).pin("b" * 64, 100, budget=1 << 30)  # a pin made while it was writable
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(root)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here")
    try:
        yield root
    finally:
        subprocess.run(["chattr", "-i", str(root)], check=False)


def test_a_pin_or_unpin_a_read_only_dir_refuses_raises_and_changes_nothing(read_only_dir: Path) -> None:
    pins = Pins(read_only_dir)
    with pytest.raises(PinsNotSaved, match="refused"):
        pins.pin("a" * 64, 100, budget=1 << 30)
    with pytest.raises(PinsNotSaved, match="refused"):
        pins.unpin("b" * 64)
    assert pins.level("a" * 64) is Level.NONE and pins.level("b" * 64) is Level.PINNED
    assert Pins(read_only_dir).pinned() == {"b" * 64: 100}  # what the next start reads: as it was


def test_a_full_disk_refuses_a_pin_and_still_trims_to_its_budget(tmp_path: Path) -> None:
    """The budget was enforced only after a write succeeded: a full disk never trimmed."""
    filler = disk(tmp_path)
    for i in range(4):
        filler.save(make_entry([i] * 16, seed=i))
    file_bytes = filler.usage()[1] // 4
    filler.close()
    budget = int(2.5 * file_bytes)
    done = subprocess.run([sys.executable, "-c", _ON_A_FULL_DISK, str(tmp_path), str(budget)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert "refused" in result["pin"] and result["pinned"] == "NONE"
    assert result["save"] == "write"  # the write itself failed (a miss plus a counter, as before)
    assert result["usage"] <= budget  # but the dir is within its budget


def test_a_retention_deleted_through_one_server_is_never_written_back_by_another(tmp_path: Path) -> None:
    """Server 1 retained X (a request's "24h"); server 2's DELETE removed X and its record from
    pins.json; server 1's next change to the file wrote the retention it still knew back, so X,
    computed again on server 2 by a plain request, came back retained for a day."""
    x, y = make_entry(list(range(16))), make_entry([7] * 16, seed=7)
    one, two = PrefixStore(RamTier(1 << 30), disk(tmp_path)), PrefixStore(RamTier(1 << 30), disk(tmp_path))
    try:
        one.retain(x.key.digest, 3600.0, tenant="key-A")
        for entry in (x, y):
            one.insert(entry)
        assert one.flush(30)
        one.pin(y.key.digest, budget_bytes=1 << 30)  # a change that writes the file: X's retention with it
        assert two.find(x.key.digest) is not None and two.find(x.key.digest).retain_until > 0  # type: ignore[union-attr]
        one.retain(x.key.digest, 3600.0, tenant="key-A")  # renewed before the delete: not written (lazily)
        one.pins.refresh()  # server 1's watcher, within a second: the file still holds X
        assert two.remove(x.key.digest) is True
        one.unpin(y.key.digest)  # server 1 changes the file again, after the delete
        assert x.key.digest not in json.loads((tmp_path / PINS_FILE).read_text())["entries"]
        two.insert(x)  # a plain request computes X again on server 2
        assert [(info.digest, info.retain_until) for info in two.entries() if info.digest == x.key.digest] == \
            [(x.key.digest, 0.0)]
        assert one.pins.level(x.key.digest) is Level.NONE  # server 1's RAM copy is no longer retained either
    finally:
        one.close()
        two.close()


def test_the_disk_budget_never_deletes_a_file_another_process_is_pinning(tmp_path: Path) -> None:
    """The budget read the pins, then picked and deleted files: a pin another process recorded in
    between (under pins.lock, as every pin is) lost its file. Now the pick and the deletes wait for
    a pin in progress and see it. The test takes pins.lock as the pinning process does."""
    x, y, z = (make_entry([300 + 16 * i + t for t in range(16)], seed=30 + i) for i in range(3))
    probe = disk(tmp_path / "probe")
    probe.save(x)
    tier = disk(tmp_path / "cache", budget_bytes=2 * probe.usage()[1])
    for entry in (x, y):
        tier.save(entry)
    saving = threading.Thread(target=tier.save, args=(z,))  # over budget: x is the oldest
    with locked(tmp_path / "cache" / LOCK_FILE):  # another process, mid-pin of x
        saving.start()
        saving.join(timeout=2)  # before: the save deleted x here, under the pin in progress
        write_holds(tmp_path / "cache" / PINS_FILE, {x.key.digest: Hold(pinned=True, num_bytes=x.num_bytes)})
    saving.join()
    on_disk = {record.digest for record in tier.records()}
    assert on_disk == {x.key.digest, z.key.digest}  # the pinned x kept; y went instead
    tier.close()
    probe.close()
