"""The prefix store over RAM and disk: lookup order, promotion, background writes, faults."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.kvcache.block_pool import RamTier
from gateway.kvcache.disk_tier import DiskTier
from gateway.kvcache.entry import CacheEntry
from gateway.kvcache.store import PrefixStore
from tests.kvcache.entries import IDENTITY, bitwise_equal, disk, make_entry

TOKENS = list(range(200, 232))


@pytest.fixture
def stores() -> Iterator[list[PrefixStore]]:
    """Stores a test opens; their writer threads are closed afterwards."""
    opened: list[PrefixStore] = []
    yield opened
    for store in opened:
        store.close()


def _store(stores: list[PrefixStore], tier: DiskTier | None, ram_bytes: int = 1 << 30) -> PrefixStore:
    store = PrefixStore(RamTier(ram_bytes), tier)
    stores.append(store)
    return store


def test_lookup_goes_ram_then_disk_and_promotes_a_disk_hit(tmp_path: Path, stores: list[PrefixStore]) -> None:
    entry = make_entry(TOKENS)
    first = _store(stores, disk(tmp_path))
    first.insert(entry)
    assert first.flush(timeout_s=30)
    assert first.lookup(entry.key).tier == "ram"  # type: ignore[union-attr]

    restarted = _store(stores, disk(tmp_path))  # empty RAM, same dir: a process restart
    found = restarted.lookup(entry.key)
    assert found is not None and found.tier == "disk" and bitwise_equal(found.entry, entry)
    again = restarted.lookup(entry.key)
    assert again is not None and again.tier == "ram" and again.entry is found.entry
    assert restarted.lookup(make_entry(TOKENS[1:]).key) is None


def test_insert_returns_while_the_disk_write_is_still_running(tmp_path: Path, stores: list[PrefixStore]) -> None:
    release, started = threading.Event(), threading.Event()

    class SlowDisk(DiskTier):
        def save(self, entry: CacheEntry) -> list[str]:
            started.set()
            release.wait(timeout=30)
            return super().save(entry)

    entry = make_entry(TOKENS)
    store = _store(stores, SlowDisk(tmp_path, 1 << 30, IDENTITY))
    store.insert(entry)  # returns although the write is blocked
    assert started.wait(timeout=30)
    assert store.lookup(entry.key).tier == "ram"  # type: ignore[union-attr]
    assert not store.flush(timeout_s=0.01)
    release.set()
    assert store.flush(timeout_s=30) and disk(tmp_path).path_for(entry.key.digest).is_file()


def test_a_corrupt_file_is_a_miss_with_a_counter_and_a_warning(
        tmp_path: Path, stores: list[PrefixStore], caplog: pytest.LogCaptureFixture) -> None:
    entry = make_entry(TOKENS)
    disk(tmp_path).save(entry)
    path = disk(tmp_path).path_for(entry.key.digest)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    store = _store(stores, disk(tmp_path))
    with caplog.at_level(logging.WARNING, logger="gateway.kvcache.store"):
        assert store.lookup(entry.key) is None
    assert store.tally.drain() == {("error", "checksum"): 1}
    assert "recomputing" in caplog.text
    store.insert(entry)  # the caller recomputed: the next write replaces the bad file
    assert store.flush(timeout_s=30) and bitwise_equal(disk(tmp_path).load(entry.key), entry)  # type: ignore[arg-type]


def test_a_failed_disk_write_keeps_serving_from_ram(tmp_path: Path, stores: list[PrefixStore]) -> None:
    (tmp_path / "kv").write_text("not a directory")
    entry = make_entry(TOKENS)
    store = _store(stores, disk(tmp_path))
    store.insert(entry)
    assert store.flush(timeout_s=30)
    assert store.tally.drain() == {("error", "write"): 1}
    assert store.lookup(entry.key).tier == "ram"  # type: ignore[union-attr]


def test_disk_evictions_are_counted(tmp_path: Path, stores: list[PrefixStore]) -> None:
    a, b = make_entry(TOKENS, seed=1), make_entry(TOKENS[1:], seed=2)
    store = _store(stores, disk(tmp_path, budget_bytes=a.num_bytes + a.num_bytes // 2 + 4096))
    for entry in (a, b):
        store.insert(entry)
        assert store.flush(timeout_s=30)
    assert store.tally.drain() == {("eviction", "disk"): 1}
    assert [r.digest for r in store.disk.records()] == [b.key.digest]  # type: ignore[union-attr]


def test_an_entry_larger_than_the_disk_budget_stays_in_ram_only(tmp_path: Path, stores: list[PrefixStore]) -> None:
    entry = make_entry(TOKENS)
    store = _store(stores, disk(tmp_path, budget_bytes=entry.num_bytes // 2))
    store.insert(entry)
    assert store.flush(timeout_s=30)
    assert store.disk.usage() == (0, 0) and store.tally.drain() == {}  # type: ignore[union-attr]


def test_entries_list_both_tiers_and_remove_and_clear_cover_both(tmp_path: Path, stores: list[PrefixStore]) -> None:
    a, b = make_entry(TOKENS, seed=1), make_entry(TOKENS[2:], seed=2)
    writer = _store(stores, disk(tmp_path))
    writer.insert(a)
    assert writer.flush(timeout_s=30)
    store = _store(stores, disk(tmp_path))
    store.insert(b)
    assert store.flush(timeout_s=30)
    listed = {info.digest: info.tiers for info in store.entries()}
    assert listed == {a.key.digest: ("disk",), b.key.digest: ("ram", "disk")}

    assert store.remove(b.key.digest) and not store.remove(b.key.digest)
    assert store.lookup(b.key) is None
    assert store.clear() == 1 and store.entries() == [] and store.lookup(a.key) is None


def test_removing_an_entry_cancels_its_pending_disk_write(tmp_path: Path, stores: list[PrefixStore]) -> None:
    release = threading.Event()

    class SlowDisk(DiskTier):
        def save(self, entry: CacheEntry) -> list[str]:
            release.wait(timeout=30)
            return super().save(entry)

    blocker, doomed = make_entry(TOKENS, seed=1), make_entry(TOKENS[3:], seed=2)
    store = _store(stores, SlowDisk(tmp_path, 1 << 30, IDENTITY))
    store.insert(blocker)
    store.insert(doomed)  # queued behind the blocked write
    assert store.remove(doomed.key.digest)
    release.set()
    assert store.flush(timeout_s=30)
    assert [r.digest for r in disk(tmp_path).records()] == [blocker.key.digest]


def test_close_finishes_pending_writes(tmp_path: Path) -> None:
    entries = [make_entry(TOKENS[i:], seed=i) for i in range(5)]
    store = PrefixStore(RamTier(1 << 30), disk(tmp_path))
    for entry in entries:
        store.insert(entry)
    store.close()
    assert {r.digest for r in disk(tmp_path).records()} == {e.key.digest for e in entries}
