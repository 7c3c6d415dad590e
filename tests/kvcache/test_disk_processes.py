"""The disk tier under real processes: a writer killed mid-write, two writers sharing one dir,
and a disk that refuses writes (a file-size limit, as a full disk does)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from gateway.kvcache.entry import PrefixKey
from tests.kvcache.entries import IDENTITY, bitwise_equal, disk, make_entry

ROOT = Path(__file__).resolve().parents[2]
ENTRY_NAME = re.compile(r"[0-9a-f]{64}\.safetensors")

_ENDLESS_WRITER = """
import sys
from pathlib import Path
from gateway.kvcache import disk_tier
from tests.kvcache.entries import disk, make_entry
real_write_entry = disk_tier.write_entry
def write_entry_and_report(*args, **kwargs):  # the temp file is written; the rename follows
    real_write_entry(*args, **kwargs)
    print("temp written", flush=True)
disk_tier.write_entry = write_entry_and_report
tier = disk(Path(sys.argv[1]))
i = 0
while True:
    tier.save(make_entry([i] * 16, seed=i, seq_len=32768))
    i += 1
"""

_BIG_WRITER = """
import sys
from pathlib import Path
from tests.kvcache.entries import disk, make_entry
tier, i = disk(Path(sys.argv[1])), 0
print("ready", flush=True)
while True:
    tier.save(make_entry([i] * 16, seed=i, seq_len=1 << 18))  # 32 MB each: a wide window to kill in
    i += 1
"""

_RACING_WRITER = """
import sys
from pathlib import Path
from tests.kvcache.entries import bitwise_equal, disk, make_entry
root, me, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
tier = disk(root)
shared = [make_entry([1000 + s] * 16, seed=1000 + s, seq_len=2048) for s in range(3)]
own = [make_entry([me * 100 + r] * 16, seed=me * 100 + r, seq_len=2048) for r in range(rounds)]
print("ready", flush=True)
sys.stdin.readline()
for r in range(rounds):
    for entry in shared:
        tier.remove(entry.key.digest)
        tier.save(entry)
        got = tier.load(entry.key)  # None if the other process just removed it; never a bad file
        assert got is None or bitwise_equal(got, entry), "read a wrong entry"
    tier.save(own[r])
print("done", flush=True)
"""

_WRITER_ON_A_FULL_DISK = """
import json, resource, signal, sys
from pathlib import Path
from gateway.kvcache.block_pool import RamTier
from gateway.kvcache.store import PrefixStore
from tests.kvcache.entries import disk, make_entry
entry = make_entry([7] * 16, seq_len=4096)
store = PrefixStore(RamTier(1 << 30), disk(Path(sys.argv[1])))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG like ENOSPC, not a killed process
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
store.insert(entry)
assert store.flush(timeout_s=30)
found = store.lookup(entry.key)
print(json.dumps({"errors": {k[1]: v for k, v in store.tally.drain().items()}, "tier": found and found.tier}))
"""


def expected_digest(i: int) -> str:
    return PrefixKey.of(IDENTITY, [i] * 16).digest


def _python(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", script, *args], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_writer_killed_mid_write_never_leaves_a_readable_bad_file(tmp_path: Path) -> None:
    writer = _python(_ENDLESS_WRITER, str(tmp_path))
    assert writer.stdout is not None
    for _ in range(4):  # three entries written; the fourth between its temp file and the rename
        assert writer.stdout.readline().startswith("temp written"), writer.stderr.read() if writer.stderr else ""
    writer.send_signal(signal.SIGKILL)
    writer.communicate(timeout=30)

    tier = disk(tmp_path)
    on_disk = {r.digest for r in tier.records()}
    expected = {expected_digest(i): i for i in range(4)}
    # the fourth is a temp file, unless its rename beat the kill; nothing else is listed
    assert on_disk <= set(expected) and set(expected) - on_disk in ({expected_digest(3)}, set())
    for digest in on_disk:
        i = expected[digest]
        loaded = tier.load(PrefixKey.of(IDENTITY, [i] * 16))
        assert loaded is not None and bitwise_equal(loaded, make_entry([i] * 16, seed=i, seq_len=32768))
    assert not (tmp_path / "quarantine").exists()


def _kill_while_writing(root: Path) -> list[Path]:
    """SIGKILL a writer as soon as a half-written file shows in the kv dir; the files left that
    are not entries."""
    writer = _python(_BIG_WRITER, str(root))
    assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
    kv_dir, leftovers = root / "kv", []
    while not leftovers and writer.poll() is None:  # polls the dir for a condition, no sleep
        names = os.listdir(kv_dir) if kv_dir.is_dir() else []
        leftovers = [kv_dir / n for n in names if not ENTRY_NAME.fullmatch(n)]
    writer.send_signal(signal.SIGKILL)
    writer.communicate(timeout=30)
    return [p for p in leftovers if p.exists()]


def test_a_writer_killed_mid_write_leaves_only_temps_that_are_budgeted_and_swept(tmp_path: Path) -> None:
    """Whatever the writer leaves counts against the budget until a start-up sweep removes it
    (safetensors' own save_file left `.tmpXXXXXX` files nothing knew about)."""
    for attempt in range(5):  # the kill can land just after a rename: then there is nothing to see
        root = tmp_path / str(attempt)
        if leftovers := _kill_while_writing(root):
            break
    assert leftovers, "no kill landed mid-write in 5 attempts"
    on_disk = sum(p.lstat().st_size for p in (root / "kv").iterdir())
    assert disk(root).usage()[1] == on_disk  # the budget sees every byte, temps included
    hour_ago = time.time() - 3600
    for path in leftovers:
        os.utime(path, (hour_ago, hour_ago))
    disk(root).sweep_stale_temps()  # what a gateway does at start-up
    assert all(ENTRY_NAME.fullmatch(p.name) for p in (root / "kv").iterdir())
    assert disk(root).usage()[1] == sum(r.num_bytes for r in disk(root).records())


def test_two_processes_writing_the_same_and_different_entries(tmp_path: Path) -> None:
    rounds = 12
    writers = [_python(_RACING_WRITER, str(tmp_path), str(me), str(rounds)) for me in (1, 2)]
    for writer in writers:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
    for writer in writers:  # both start at once
        assert writer.stdin is not None
        writer.stdin.write("go\n")
        writer.stdin.flush()
    for writer in writers:
        out, err = writer.communicate(timeout=300)
        assert writer.returncode == 0 and out.strip() == "done", err

    tier = disk(tmp_path)
    shared = [make_entry([1000 + s] * 16, seed=1000 + s, seq_len=2048) for s in range(3)]
    own = [make_entry([me * 100 + r] * 16, seed=me * 100 + r, seq_len=2048) for me in (1, 2) for r in range(rounds)]
    assert {r.digest for r in tier.records()} == {e.key.digest for e in shared + own}
    for entry in shared + own:
        assert bitwise_equal(tier.load(entry.key), entry)  # type: ignore[arg-type]
    assert sorted(p.name for p in tier.kv_dir.iterdir() if p.name.startswith(".")) == []  # no temp files


def test_a_full_disk_costs_a_counter_not_the_entry(tmp_path: Path) -> None:
    writer = _python(_WRITER_ON_A_FULL_DISK, str(tmp_path))
    out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err
    assert json.loads(out) == {"errors": {"write": 1}, "tier": "ram"}
    assert "disk cache write failed" in err
    assert list((tmp_path / "kv").iterdir()) == []  # the partial temp file was removed
