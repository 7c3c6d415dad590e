"""Retention is a share, not a priority over other tenants (issue 36): `prompt_cache_retention`
protects a tenant's groups only within its max-min fair share of `retained_budget_bytes`, newest
retention first; past it, its retentions are plain LRU entries and go before another tenant's
protected ones. Exact eviction orders, without a model (RAM tier, disk tier, the store)."""

from __future__ import annotations

from pathlib import Path

from gateway.kvcache import pins as pins_module
from gateway.kvcache.block_pool import RamTier
from gateway.kvcache.disk_tier import DiskTier
from gateway.kvcache.entry import CacheEntry
from gateway.kvcache.pins import Level, Pins, tenant_label
from gateway.kvcache.shares import Retained, fair_shares, protected
from gateway.kvcache.store import PrefixStore
from tests.kvcache.entries import IDENTITY, disk, make_entry


def _entries(names: str) -> dict[str, CacheEntry]:
    return {name: make_entry([1000 * i + t for t in range(16)], seed=i) for i, name in enumerate(names)}


def test_fair_shares_give_small_demands_all_and_split_the_rest_evenly() -> None:
    assert fair_shares({"a": 500, "b": 100, "c": 250}, 600) == {"b": 100, "c": 250, "a": 250}
    assert fair_shares({"a": 500, "b": 500}, 600) == {"a": 300, "b": 300}
    assert fair_shares({"a": 50}, 600) == {"a": 50}
    assert fair_shares({}, 600) == {}


def test_a_tenant_keeps_its_newest_retentions_that_fit_its_share() -> None:
    held = [Retained(f"a{i}", "A", 100.0 + i, 10) for i in range(5)] + [Retained("b0", "B", 50.0, 10)]
    assert protected(held, 30) == {"a4", "a3", "b0"}  # B asks 10 of 15; A gets the 20 left
    assert protected(held, 0) == set()
    big_first = [Retained("new", "A", 200.0, 40), Retained("old", "A", 100.0, 5)]
    assert protected(big_first, 30) == set()  # a share never skips to an older, smaller retention


def test_ram_eviction_takes_the_flooders_retentions_past_its_share_first() -> None:
    """Key A retains five groups, key B one; the budget protects three groups' bytes: B's one and
    A's two newest. New plain groups evict A's older retentions (as plain LRU entries), then the
    plain ones; B's group goes only when nothing else is left."""
    entries = _entries("bxyz")  # b: B's; x, y, z: plain arrivals later
    size = entries["b"].num_bytes
    pins = Pins(None, retained_budget_bytes=3 * size)
    a_names = ["a0", "a1", "a2", "a3", "a4"]
    a_entries = {n: make_entry([50_000 + 100 * i + t for t in range(16)], seed=50 + i) for i, n in enumerate(a_names)}
    ram = RamTier(6 * size, guard=pins.level)
    for name, entry in [("b", entries["b"]), *a_entries.items()]:
        ram.insert(entry)
        pins.retain(entry.key.digest, 3600.0 + len(ram), tenant="key-B" if name == "b" else "key-A")
        pins.note_bytes(entry.key.digest, entry.num_bytes)
    name_of = {e.key.digest: n for n, e in [("b", entries["b"]), *a_entries.items(),
                                            *((k, entries[k]) for k in "xyz")]}
    levels = {name_of[e.key.digest]: pins.level(e.key.digest) for e in ram.entries()}
    assert levels == {"b": Level.RETAINED, "a0": Level.NONE, "a1": Level.NONE, "a2": Level.NONE,
                      "a3": Level.RETAINED, "a4": Level.RETAINED}

    evicted = [name_of[ev.digest] for k in "xyz" for ev in ram.insert(entries[k])]
    assert evicted == ["a0", "a1", "a2"]
    drained = []
    while (ev := ram.evict_oldest(up_to=Level.PINNED)) is not None:
        drained.append(name_of[ev.digest])
    assert drained == ["x", "y", "z", "b", "a3", "a4"]  # unprotected first, then retained, LRU order


def test_without_a_flood_every_tenant_keeps_all_it_retained() -> None:
    entries = _entries("pq")
    pins = Pins(None, retained_budget_bytes=4 * entries["p"].num_bytes)
    for name, entry in entries.items():
        pins.retain(entry.key.digest, 3600.0, tenant=name)
        pins.note_bytes(entry.key.digest, entry.num_bytes)
    assert [pins.level(e.key.digest) for e in entries.values()] == [Level.RETAINED, Level.RETAINED]
    assert {tenant for tenant, _, kept in pins.retained().values() if kept} == {tenant_label("p"), tenant_label("q")}


def test_a_retention_made_before_its_entry_exists_counts_its_bytes_once_stored() -> None:
    entries = _entries("ab")
    store = PrefixStore(RamTier(1 << 30), retained_budget_bytes=entries["a"].num_bytes)
    for entry in entries.values():  # as a request does: retained first, computed and stored after
        store.retain(entry.key.digest, 3600.0, tenant="key-A")
    for entry in entries.values():
        store.insert(entry)
    assert [store.pins.level(e.key.digest) for e in entries.values()] == [Level.NONE, Level.RETAINED]


def test_the_disk_budget_takes_the_flooders_retentions_past_its_share_first(tmp_path: Path) -> None:
    entries = {n: make_entry([7000 + 100 * i + t for t in range(16)], seed=70 + i) for i, n in
               enumerate(["b", "a0", "a1", "a2", "a3", "x"])}
    probe = disk(tmp_path / "probe")
    probe.save(entries["b"])
    file_bytes = probe.usage()[1]
    tier = DiskTier(tmp_path / "cache", 5 * file_bytes, IDENTITY, retained_budget_bytes=3 * file_bytes)
    for n, (name, entry) in enumerate(entries.items()):
        if name != "x":
            tier.pins.retain(entry.key.digest, 3600.0 + n, tenant="key-B" if name == "b" else "key-A")
        tier.save(entry)
    on_disk = {r.digest for r in tier.records()}
    kept = {name for name, entry in entries.items() if entry.key.digest in on_disk}
    assert kept == {"b", "a1", "a2", "a3", "x"}  # A's oldest went, as a plain file; B's stayed
    tier.save(make_entry([9999] * 16, seed=99))
    kept = {name for name, entry in entries.items() if entry.key.digest in {r.digest for r in tier.records()}}
    assert kept == {"b", "a2", "a3", "x"}  # then A's next one past its share, before the plain x
    tier.close()


def test_a_flood_of_distinct_retentions_drops_its_own_records_not_another_tenants() -> None:
    """Past the record bound the retentions that ended first went, whoever held them: key A's
    flood of distinct retained groups (each a request) pushed key B's older retentions out, and
    B's groups were plain LRU entries again. Now the tenant holding the most records gives way."""
    bound = pins_module._MAX_RECORDS
    pins = Pins(None)
    b_digests = [f"b{n:063x}" for n in range(3)]
    for digest in b_digests:
        pins.retain(digest, 3600.0, tenant="key-B")
    for n in range(bound * 3 // 2):
        pins.retain(f"a{n:063x}", 7200.0 + n, tenant="key-A")
    assert [pins.level(d) for d in b_digests] == [Level.RETAINED] * 3
    assert len(pins.retained()) <= bound + bound // 8
    assert f"a{bound * 3 // 2 - 1:063x}" in pins.retained()  # A keeps its latest


def test_retention_never_protects_more_than_half_the_pool() -> None:
    """With retained_budget_bytes (512 MiB by default) at or above the KV pool, the only key asking
    for retention had its share cover the whole pool: key B's plain group was evicted at each of
    A's retained groups. Retention now protects at most half the pool; the rest is LRU."""
    entries = _entries("ba")
    size = entries["b"].num_bytes
    store = PrefixStore(RamTier(4 * size))  # the default retained budget: far above this pool
    a_entries = [make_entry([60_000 + 100 * i + t for t in range(16)], seed=60 + i) for i in range(4)]
    for entry in a_entries[:3]:
        store.retain(entry.key.digest, 3600.0, tenant="key-A")
        store.insert(entry)
    store.insert(entries["b"])  # B's group, no retention asked
    for entry in a_entries[3:]:
        store.retain(entry.key.digest, 3600.0, tenant="key-A")
        store.insert(entry)
    assert store.lookup(entries["b"].key) is not None  # B's resend hits: A's oldest retention went
    assert store.lookup(a_entries[0].key) is None


def test_another_keys_retention_of_a_shared_group_never_takes_it_out_of_its_share() -> None:
    """A shared group (`shared_groups`) has one digest for every key. Key B retained it; key A
    retained it too and was charged for it (the latest request's key), then flooded its own
    retained groups: the shared group fell out of A's share and B's retention protected nothing."""
    shared = make_entry([4242] * 16, seed=42)
    size = shared.num_bytes
    pins = Pins(None, retained_budget_bytes=4 * size)
    pins.retain(shared.key.digest, 3600.0, tenant="key-B")
    pins.note_bytes(shared.key.digest, size)
    pins.retain(shared.key.digest, 7200.0, tenant="key-A")
    for n in range(5):
        digest = f"a{n:063x}"
        pins.retain(digest, 7200.0 + n, tenant="key-A")
        pins.note_bytes(digest, size)
    assert pins.level(shared.key.digest) is Level.RETAINED
    assert pins.retained()[shared.key.digest][0] == tenant_label("key-B")
