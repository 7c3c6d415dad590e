"""Pinned tool groups and `prompt_cache_retention`: a pinned group survives the memory pressure that
evicts an unpinned one, unpinning makes it evictable again, pins survive a restart and the disk
budget, a pin past `pinned_budget_bytes` is a 400 naming the setting; a request's `"24h"` retention
keeps its group under pressure, a bad value is a 400. On real servers (tiny model), after the
tiers' own rules (no server)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.kvcache import pins as pins_module
from gateway.kvcache.block_pool import RamTier
from gateway.kvcache.disk_tier import DiskTier
from gateway.kvcache.pins import PINS_FILE, Level, PinBudgetExceeded, Pins
from gateway.kvcache.store import PrefixStore
from gateway.settings import load_settings
from tests.kvcache.entries import disk, make_entry
from tests.support.server import serve
from tests.support.waiting import wait_until

BYTES_PER_TOKEN = 512  # the tiny model: 2 layers x (k, v) x 2 kv heads x 16 dims x 4 bytes
BLOCK_TOKENS = 16
NAMES = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot")
# Groups differ early in their system prompt and in their tools (whichever the template puts
# first), so no group lends another its first chunks: a group that is gone is a plain miss.
GROUPS = [f"{name.title()} shop assistant: answer the customer briefly and call a tool when one fits."
          for name in NAMES]


def _tools(group: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {
        "name": name, "description": f"{NAMES[group]}: {name.replace('_', ' ')} for a customer",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}
        for name in ("get_order", "cancel_order", "refund_order")]


# ---- the tiers' rules, without a server ------------------------------------------------------------


def test_the_ram_tier_evicts_unprotected_entries_first_and_pinned_ones_only_when_told() -> None:
    pins = Pins(None)
    entries = [make_entry(list(range(i * 100, i * 100 + 16)), seed=i) for i in range(3)]
    ram = RamTier(3 * entries[0].num_bytes, guard=pins.level)
    for entry in entries:
        ram.insert(entry)
    pinned, retained, plain = (e.key.digest for e in entries)
    pins.pin(pinned, entries[0].num_bytes, budget=1 << 30)
    pins.retain(retained, 3600)
    assert [pins.level(d) for d in (pinned, retained, plain)] == [Level.PINNED, Level.RETAINED, Level.NONE]

    ram.insert(make_entry(list(range(900, 916)), seed=9))  # over the byte budget: the plain one goes
    held = {e.key.digest for e in ram.entries()}
    assert pinned in held and retained in held and plain not in held
    ram.insert(make_entry(list(range(950, 966)), seed=8))  # and again: the newest unprotected one goes
    assert {pinned, retained} < {e.key.digest for e in ram.entries()}

    evicted = [ram.evict_oldest(up_to=Level.PINNED) for _ in range(len(ram))]
    assert [e.level for e in evicted if e is not None][-2:] == [Level.RETAINED, Level.PINNED]
    assert ram.evict_oldest() is None


def test_pins_and_retention_live_in_a_file_beside_the_entries(tmp_path: Path) -> None:
    tier = disk(tmp_path)
    a, b = make_entry(list(range(16)), seed=1), make_entry(list(range(50, 66)), seed=2)
    tier.save(a)
    tier.save(b)
    assert tier.pins.pin(a.key.digest, a.num_bytes, budget=a.num_bytes) is True
    with pytest.raises(PinBudgetExceeded, match="pinned_budget_bytes"):
        tier.pins.pin(b.key.digest, b.num_bytes, budget=a.num_bytes)
    tier.pins.retain(b.key.digest, 3600)
    tier.pins.close()  # the retention's background write is done

    again = Pins(tmp_path)  # another process, or the next start
    assert again.level(a.key.digest) is Level.PINNED and again.level(b.key.digest) is Level.RETAINED
    assert again.pinned() == {a.key.digest: a.num_bytes}
    tier.remove(a.key.digest)  # removing an entry drops its pin
    again.refresh()
    assert again.level(a.key.digest) is Level.NONE

    (tmp_path / PINS_FILE).write_text("{not json")
    assert Pins(tmp_path).pinned() == {}  # a damaged file pins nothing; it stops nothing either


def test_a_pin_file_that_cannot_be_read_never_wipes_the_pins_known_here(tmp_path: Path) -> None:
    """A damaged or oversized pins.json used to read as empty, replace this process's pins, and be
    written back empty by the next change: every process on the dir lost its pins."""
    pins = Pins(tmp_path)
    pinned = "a" * 64
    pins.pin(pinned, 100, budget=1 << 30)
    (tmp_path / PINS_FILE).write_text("{not json")
    pins.refresh()
    assert pins.level(pinned) is Level.PINNED
    pins.pin("b" * 64, 100, budget=1 << 30)  # the next change writes the known pins over the damage
    assert Pins(tmp_path).pinned() == {pinned: 100, "b" * 64: 100}


def test_a_pin_file_at_its_record_bound_is_still_read_whole(tmp_path: Path) -> None:
    """Retentions past the bound give way (those that end first); the file stays under the size a
    reader takes, so its pins are never lost to size."""
    pins = Pins(tmp_path)
    pinned = "f" * 64
    pins.pin(pinned, 10**15, budget=10**16)
    for n in range(pins_module._MAX_RECORDS + 500):
        pins.retain(f"{n:064x}", 3600.0 + n)
    pins.close()
    pins.unpin("e" * 64)  # a change: the whole set is written now
    assert (tmp_path / PINS_FILE).stat().st_size <= pins_module._MAX_FILE_BYTES
    again = Pins(tmp_path)
    assert again.pinned() == {pinned: 10**15} and again.level(f"{0:064x}") is Level.NONE
    assert again.level(f"{pins_module._MAX_RECORDS + 499:064x}") is Level.RETAINED


def test_a_pin_made_by_another_process_reaches_eviction_within_a_second(tmp_path: Path) -> None:
    """A look at a level only started a refresh, so an idle server's first eviction judged by what
    it had read long before (another server's pin took ~2 s to show). A watcher reads the file
    every second; eviction's looks never touch the disk."""
    here, there = Pins(tmp_path), Pins(tmp_path)
    digest = "c" * 64
    try:
        assert here.level(digest) is Level.NONE
        there.pin(digest, 100, budget=1 << 30)
        started = time.monotonic()
        assert wait_until(lambda: here.level(digest) is Level.PINNED)  # the watcher's read
        assert here.pinned() == {digest: 100}
        assert time.monotonic() - started < 3 * pins_module._REFRESH_EVERY_S  # slack for a loaded machine
    finally:
        here.close()
        there.close()


def test_the_disk_budget_never_evicts_a_pinned_file(tmp_path: Path) -> None:
    entries = [make_entry(list(range(i * 100, i * 100 + 16)), seed=i) for i in range(4)]
    probe = disk(tmp_path / "probe")
    probe.save(entries[0])
    file_bytes = probe.usage()[1]
    tier = DiskTier(tmp_path / "cache", int(2.5 * file_bytes), probe.identity)
    tier.save(entries[0])
    tier.pins.pin(entries[0].key.digest, entries[0].num_bytes, budget=1 << 30)
    for entry in entries[1:]:
        tier.save(entry)
    on_disk = {r.digest for r in tier.records()}
    assert entries[0].key.digest in on_disk and entries[1].key.digest not in on_disk and len(on_disk) == 2


def test_a_store_lists_pins_and_forgets_them_with_their_entries(tmp_path: Path) -> None:
    store = PrefixStore(RamTier(1 << 30), disk(tmp_path))
    try:
        entry = make_entry(list(range(16)))
        store.insert(entry)
        assert store.flush(30)
        pinned = store.pin(entry.key.digest, budget_bytes=1 << 30)
        assert pinned is not None and pinned.pinned and store.pinned_bytes() == entry.num_bytes
        assert [i.pinned for i in store.entries()] == [True]
        assert store.pin("0" * 64, budget_bytes=1 << 30) is None
        unpinned = store.unpin(entry.key.digest)
        assert unpinned is not None and not unpinned.pinned and store.pinned_bytes() == 0
        store.pin(entry.key.digest, budget_bytes=1 << 30)
        assert store.clear() == 1 and store.pinned_bytes() == 0
    finally:
        store.close()


def test_an_entry_counts_the_same_bytes_pinned_from_ram_or_from_disk(tmp_path: Path) -> None:
    """Replicas sharing a cache dir pin through one pin file: the one holding the group only on disk
    must count what the one holding it in RAM counts, or the pinned total depends on who came first."""
    entry = make_entry(list(range(16)))
    writer = PrefixStore(RamTier(1 << 30), disk(tmp_path))
    reader = PrefixStore(RamTier(1 << 30), disk(tmp_path))  # another replica: the entry is only on its disk
    try:
        writer.insert(entry)
        assert writer.flush(30)
        on_disk = reader.find(entry.key.digest)
        assert on_disk is not None and on_disk.tiers == ("disk",)
        assert reader.disk is not None and [r.num_bytes > entry.num_bytes for r in reader.disk.records()] == [True]
        assert on_disk.num_bytes == entry.num_bytes  # its keys and values, not the file with its header
        assert reader.pin(entry.key.digest, budget_bytes=1 << 30) is not None
        assert writer.pin(entry.key.digest, budget_bytes=1 << 30) is not None
        assert reader.pinned_bytes() == writer.pinned_bytes() == entry.num_bytes
    finally:
        writer.close()
        reader.close()


# ---- on a real server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[..., Path]) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def group_bytes(model: str, tmp_path_factory: pytest.TempPathFactory) -> int:
    """The KV pool bytes the largest of GROUPS takes (measured on a roomy server)."""
    with _server(model, tmp_path_factory.mktemp("measure"), disk_budget_bytes=0) as api:
        sizes = [_warm(api, i)["prefix_tokens"] for i in range(len(GROUPS))]
    blocks = -(-max(sizes) // BLOCK_TOKENS)
    return blocks * BLOCK_TOKENS * BYTES_PER_TOKEN


@contextmanager
def _server(model: str, cache_dir: Path, **overrides: Any) -> Iterator[httpx.Client]:
    """A server that keeps no conversation KV (a repeated prompt hits its group only)."""
    settings = load_settings(overrides={"model": model, "min_prefix_tokens": 8, "cache_dir": str(cache_dir),
                                        "conversation_reuse": "off", "kv_block_tokens": BLOCK_TOKENS,
                                        **overrides}, environ={})
    with serve(settings) as live, httpx.Client(base_url=live.api_url, timeout=120) as api:
        yield api


@pytest.fixture
def tight(model: str, group_bytes: int, tmp_path: Path) -> Iterator[httpx.Client]:
    """A RAM-only server whose pool holds three groups and a running request beside them."""
    with _server(model, tmp_path, disk_budget_bytes=0, ram_budget_bytes=int(3.6 * group_bytes),
                 pinned_budget_bytes=int(1.5 * group_bytes)) as api:
        yield api


def _warm(api: httpx.Client, group: int, **extra: Any) -> dict[str, Any]:
    resp = api.post("/cache/warm", json={"system": GROUPS[group], "tools": _tools(group), **extra})
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


def _chat(api: httpx.Client, group: int, **extra: Any) -> httpx.Response:
    return api.post("/chat/completions", json={
        "messages": [{"role": "system", "content": GROUPS[group]}, {"role": "user", "content": "Where is order 42?"}],
        "tools": _tools(group), "temperature": 0, "max_tokens": 2, **extra})


def _cached(api: httpx.Client, group: int) -> int:
    resp = _chat(api, group)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def _pressure(api: httpx.Client, groups: range) -> None:
    for group in groups:
        _warm(api, group)


def _listed(api: httpx.Client) -> dict[str, dict[str, Any]]:
    return {e["id"]: e for e in api.get("/cache").json()["data"]}


def _pinned_bytes_metric(api: httpx.Client) -> float:
    for line in httpx.get(api.base_url.join("/metrics")).text.splitlines():
        if line.startswith("toolkv_cache_pinned_bytes "):
            return float(line.split()[1])
    raise AssertionError("toolkv_cache_pinned_bytes not exported")


def test_a_pinned_group_survives_pressure_that_evicts_an_unpinned_one(tight: httpx.Client) -> None:
    pinned = _warm(tight, 0, pin=True)
    plain = _warm(tight, 1)
    assert pinned["pinned"] is True and plain["pinned"] is False
    _pressure(tight, range(2, 6))
    listed = _listed(tight)
    assert listed[pinned["id"]]["pinned"] is True and plain["id"] not in listed
    assert _cached(tight, 0) == pinned["prefix_tokens"]
    assert _cached(tight, 1) == 0
    assert _pinned_bytes_metric(tight) == pinned["bytes"]


def test_unpinning_makes_a_group_evictable_again(tight: httpx.Client) -> None:
    warmed = _warm(tight, 0)
    pinned = tight.post(f"/cache/{warmed['id']}/pin", json={})
    assert pinned.status_code == 200 and pinned.json()["pinned"] is True
    unpinned = tight.delete(f"/cache/{warmed['id']}/pin")
    assert unpinned.status_code == 200 and unpinned.json()["pinned"] is False
    assert _pinned_bytes_metric(tight) == 0
    _pressure(tight, range(1, 6))
    assert warmed["id"] not in _listed(tight)
    assert _cached(tight, 0) == 0


def test_a_pin_past_the_budget_is_a_400_naming_the_setting(tight: httpx.Client) -> None:
    first = _warm(tight, 0, pin=True)
    second = _warm(tight, 1)
    refused = tight.post(f"/cache/{second['id']}/pin", json={})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert "pinned_budget_bytes" in error["message"] and error["code"] == "pinned_budget_exceeded"
    warm_refused = tight.post("/cache/warm", json={"system": GROUPS[2], "tools": _tools(2), "pin": True})
    assert warm_refused.status_code == 400 and warm_refused.json()["error"]["param"] == "pin"
    assert _listed(tight)[second["id"]]["pinned"] is False
    assert tight.delete(f"/cache/{first['id']}/pin").status_code == 200  # room again
    assert tight.post(f"/cache/{second['id']}/pin", json={}).json()["pinned"] is True
    assert tight.post("/cache/" + "0" * 64 + "/pin", json={}).status_code == 404
    assert tight.post("/cache/warm", json={"system": GROUPS[3], "tools": _tools(3), "pin": "yes"}).status_code == 400


def test_retention_24h_keeps_a_group_under_pressure(tight: httpx.Client) -> None:
    kept = _chat(tight, 0, prompt_cache_retention="24h")
    assert kept.status_code == 200, kept.text
    plain = _chat(tight, 1, prompt_cache_retention="in_memory")
    assert plain.status_code == 200, plain.text
    _pressure(tight, range(2, 6))
    retained = [e for e in _listed(tight).values() if e["retained_until"] is not None]
    assert len(retained) == 1 and retained[0]["retained_until"] > time.time() + 23 * 3600
    assert retained[0]["pinned"] is False
    assert _cached(tight, 0) > 0
    assert _cached(tight, 1) == 0


def test_retention_24h_on_a_responses_request_keeps_its_group(tight: httpx.Client) -> None:
    tools = [{"type": "function", **t["function"]} for t in _tools(0)]
    resp = tight.post("/responses", json={"instructions": GROUPS[0], "input": "Where is order 42?", "tools": tools,
                                          "max_output_tokens": 16, "prompt_cache_retention": "24h"})
    assert resp.status_code == 200, resp.text
    retained = [e for e in _listed(tight).values() if e["retained_until"] is not None]
    assert len(retained) == 1 and retained[0]["retained_until"] > time.time() + 23 * 3600
    bad = tight.post("/responses", json={"input": "Hi", "prompt_cache_retention": "1h"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_retention", bad.text


@pytest.mark.parametrize("value", ["1h", "", "24H", 24, True, {"ttl": "24h"}])
def test_a_bad_retention_is_a_400_naming_the_param(tight: httpx.Client, value: Any) -> None:
    resp = _chat(tight, 0, prompt_cache_retention=value)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "prompt_cache_retention"


def test_a_dir_over_a_lowered_budget_shrinks_at_start(model: str, tmp_path: Path) -> None:
    """Not only at the next write: a server that only ever hits left the dir over budget for good."""
    with _server(model, tmp_path) as api:
        newest = [_warm(api, group)["id"] for group in range(3)][-1]
    sizes = {path.name.split(".")[0]: path.stat().st_size for path in (tmp_path / "kv").iterdir()}
    assert len(sizes) == 3
    with _server(model, tmp_path, disk_budget_bytes=int(1.5 * max(sizes.values()))):
        left = {path.name.split(".")[0] for path in (tmp_path / "kv").iterdir()}
    assert left == {newest}


def test_pins_survive_a_restart_and_the_disk_budget(model: str, group_bytes: int, tmp_path: Path) -> None:
    overrides = {"ram_budget_bytes": int(3.6 * group_bytes), "pinned_budget_bytes": 2 * group_bytes}
    with _server(model, tmp_path, **overrides) as api:
        pinned = _warm(api, 0, pin=True)
        file_bytes = api.get(f"/cache/{pinned['id']}").json()["bytes"]
    assert json.loads((tmp_path / PINS_FILE).read_text())["entries"][pinned["id"]]["pinned"] is True

    # The next start: its disk holds two and a half groups; five more pass through it.
    with _server(model, tmp_path, disk_budget_bytes=int(2.5 * file_bytes), **overrides) as api:
        assert _listed(api)[pinned["id"]]["pinned"] is True
        assert _pinned_bytes_metric(api) == pinned["bytes"]
        _pressure(api, range(1, 6))
        listed = _listed(api)
        assert listed[pinned["id"]]["pinned"] is True and "disk" in listed[pinned["id"]]["tiers"]
        assert len([e for e in listed.values() if "disk" in e["tiers"]]) <= 3
        assert _cached(api, 0) == pinned["prefix_tokens"]


def test_a_pool_full_of_pinned_groups_still_serves_a_new_request(model: str, group_bytes: int,
                                                                   tmp_path: Path) -> None:
    """Pinned past what the pool holds (pinned_budget_bytes set too high): a request that finds no
    other room takes the least recently used pinned group's blocks, rather than waiting forever;
    that group leaves RAM only, and stays pinned on disk."""
    with _server(model, tmp_path, ram_budget_bytes=int(3.6 * group_bytes),
                 pinned_budget_bytes=10 * group_bytes) as api:
        pinned = [_warm(api, group, pin=True) for group in range(3)]
        assert _cached(api, 3) == 0  # computed: a 200, not a request held forever
        listed = _listed(api)
        assert all(listed[p["id"]]["pinned"] for p in pinned)
        assert listed[pinned[0]["id"]]["tiers"] == ["disk"]
        assert _cached(api, 0) == pinned[0]["prefix_tokens"]  # from disk, back into RAM
