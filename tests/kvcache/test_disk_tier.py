"""The disk tier on real files: exact round trips, atomic writes, and every kind of bad file
detected, moved aside and never used."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from gateway.kvcache.disk_format import FORMAT_VERSION, CacheFault, encode
from gateway.kvcache.disk_tier import DiskTier
from gateway.kvcache.entry import PrefixKey
from tests.kvcache.entries import IDENTITY, OTHER_MODEL, bitwise_equal, disk, make_entry

TOKENS = list(range(100, 140))


def _quarantined(root: Path) -> list[str]:
    folder = root / "quarantine"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def _assert_rejected(root: Path, key: PrefixKey, kind: str) -> None:
    tier = disk(root)
    with pytest.raises(CacheFault) as caught:
        tier.load(key)
    assert caught.value.kind == kind
    assert not tier.path_for(key.digest).exists()
    assert [name.split(".")[:2] for name in _quarantined(root)] == [[key.digest, kind]]
    assert tier.load(key) is None  # moved aside: now a plain miss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cumulative_length", [None, 4096])
def test_round_trip_is_bitwise_identical(tmp_path: Path, dtype: torch.dtype, cumulative_length: int | None) -> None:
    entry = make_entry(TOKENS, dtype=dtype, cumulative_length=cumulative_length)
    disk(tmp_path).save(entry)
    loaded = disk(tmp_path).load(entry.key)
    assert loaded is not None and bitwise_equal(loaded, entry)
    assert (loaded.key, loaded.group_id, loaded.tool_names, loaded.created_at) == (
        entry.key, entry.group_id, entry.tool_names, entry.created_at)


def test_file_is_plain_safetensors_with_the_full_header(tmp_path: Path) -> None:
    entry = make_entry(TOKENS, dtype=torch.bfloat16)
    tier = disk(tmp_path)
    tier.save(entry)
    path = tier.path_for(entry.key.digest)
    assert path.parent == tmp_path / "kv" and path.name == entry.key.digest + ".safetensors"
    with safe_open(str(path), framework="pt") as handle:
        meta = {k: json.loads(v) for k, v in (handle.metadata() or {}).items()}
    assert meta["toolkv.format"] == FORMAT_VERSION
    assert meta["toolkv.identity"] == {"model_fingerprint": "model-a", "tokenizer_fingerprint": "tokenizer-a",
                                       "adapter_version": "chatml-1"}
    assert meta["toolkv.token_ids"] == TOKENS and meta["toolkv.digest"] == entry.key.digest
    assert meta["toolkv.layers"][0] == {"dtype": "bfloat16", "keys_shape": [1, 2, 40, 8],
                                        "values_shape": [1, 2, 40, 8], "cumulative_length": None}
    assert meta["toolkv.tool_names"] == ["get_order", "refund"] and meta["toolkv.group_id"] == "tg_test"
    assert len(meta["toolkv.sha256"]) == 64 and meta["toolkv.created_at"] == entry.created_at


def test_a_leftover_temp_file_is_never_read_as_an_entry(tmp_path: Path) -> None:
    """A writer killed before its rename leaves only a temp file: that is a miss, not an entry."""
    entry = make_entry(TOKENS)
    tier = disk(tmp_path)
    tensors, metadata = encode(entry, IDENTITY)
    tier.kv_dir.mkdir(parents=True)
    save_file(tensors, str(tier.kv_dir / f".tmp-{entry.key.digest[:16]}-1-2-dead"), metadata=metadata)
    assert tier.load(entry.key) is None
    temp_bytes = (tier.kv_dir / f".tmp-{entry.key.digest[:16]}-1-2-dead").stat().st_size
    assert tier.records() == [] and tier.usage() == (0, temp_bytes)  # not an entry, but budgeted
    assert tier.sweep_stale_temps(max_age_s=0) == 1 and os.listdir(tier.kv_dir) == []


def test_a_failed_write_leaves_no_file_behind(tmp_path: Path) -> None:
    entry = make_entry(TOKENS)
    (tmp_path / "kv").write_text("a file where the entry dir should be")
    with pytest.raises(CacheFault) as caught:
        disk(tmp_path).save(entry)
    assert caught.value.kind == "write"
    assert sorted(os.listdir(tmp_path)) == ["kv"]


@pytest.mark.parametrize("keep_fraction", [0.0, 0.003, 0.5, 0.999])
def test_a_truncated_file_is_quarantined(tmp_path: Path, keep_fraction: float) -> None:
    entry = make_entry(TOKENS)
    path = disk(tmp_path).path_for(entry.key.digest)
    disk(tmp_path).save(entry)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep_fraction)])
    _assert_rejected(tmp_path, entry.key, "corrupt")


def test_a_flipped_byte_in_the_tensors_fails_the_checksum(tmp_path: Path) -> None:
    entry = make_entry(TOKENS)
    path = disk(tmp_path).path_for(entry.key.digest)
    disk(tmp_path).save(entry)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # one bit in the last layer's values
    path.write_bytes(bytes(data))
    _assert_rejected(tmp_path, entry.key, "checksum")


def test_no_flipped_byte_anywhere_yields_an_entry(tmp_path: Path) -> None:
    """Header (length prefix, tensor table, our metadata) and data: every position checked is
    either rejected or, never, accepted."""
    entry = make_entry(TOKENS[:8], num_layers=1)
    tier = disk(tmp_path)
    tier.save(entry)
    pristine = tier.path_for(entry.key.digest).read_bytes()
    header_len = struct.unpack("<Q", pristine[:8])[0] + 8
    positions = list(range(header_len)) + list(range(header_len, len(pristine), 7))
    for position in positions:
        damaged = bytearray(pristine)
        damaged[position] ^= 0x04
        tier.path_for(entry.key.digest).write_bytes(bytes(damaged))
        with pytest.raises(CacheFault):
            tier.load(entry.key)


@pytest.mark.parametrize("writer", ["another model", "another prefix"])
def test_a_file_written_for_another_key_is_rejected(tmp_path: Path, writer: str) -> None:
    """A file under our digest whose header names another model or other tokens (a copied or
    renamed file, a keying bug) is never used."""
    ours = make_entry(TOKENS)
    foreign = make_entry(TOKENS, identity=OTHER_MODEL) if writer == "another model" else make_entry(TOKENS[1:])
    disk(tmp_path, identity=OTHER_MODEL if writer == "another model" else IDENTITY).save(foreign)
    os.replace(disk(tmp_path).path_for(foreign.key.digest), disk(tmp_path).path_for(ours.key.digest))
    _assert_rejected(tmp_path, ours.key, "identity")


def test_another_models_entries_are_kept_but_not_listed(tmp_path: Path) -> None:
    theirs = make_entry(TOKENS, identity=OTHER_MODEL)
    disk(tmp_path, identity=OTHER_MODEL).save(theirs)
    ours = disk(tmp_path)
    assert ours.load(PrefixKey.of(IDENTITY, TOKENS)) is None
    assert ours.records() == [] and ours.usage()[0] == 1  # the shared budget still counts it
    assert ours.clear() == 0 and disk(tmp_path, identity=OTHER_MODEL).records()[0].digest == theirs.key.digest


def test_an_old_format_version_is_rejected(tmp_path: Path) -> None:
    entry = make_entry(TOKENS)
    path = disk(tmp_path).path_for(entry.key.digest)
    disk(tmp_path).save(entry)
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
    save_file(load_file(str(path)), str(path), metadata={**metadata, "toolkv.format": "0"})
    _assert_rejected(tmp_path, entry.key, "version")


def test_a_safetensors_file_without_our_header_is_rejected(tmp_path: Path) -> None:
    entry = make_entry(TOKENS)
    path = disk(tmp_path).path_for(entry.key.digest)
    path.parent.mkdir(parents=True)
    save_file({"k.0": torch.zeros(2)}, str(path))
    _assert_rejected(tmp_path, entry.key, "corrupt")


def test_disk_budget_evicts_least_recently_used_first(tmp_path: Path) -> None:
    a, b, c, d = (make_entry([i] * 16, seed=i) for i in range(4))
    size = _file_size(tmp_path / "probe", a)
    tier = disk(tmp_path, budget_bytes=2 * size + size // 2)  # room for two files
    assert tier.save(a) == [] and tier.save(b) == []
    assert tier.load(a.key) is not None  # a hit makes `a` the most recently used
    assert tier.save(c) == [b.key.digest]
    assert tier.save(d) == [a.key.digest]
    assert [r.digest for r in tier.records()] == [c.key.digest, d.key.digest]  # LRU first
    assert tier.usage() == (2, 2 * size)


def test_ids_are_never_paths(tmp_path: Path) -> None:
    tier = disk(tmp_path)
    for bad in ("../../etc/passwd", "a" * 63, "A" * 64, "a" * 64 + "\n", ""):
        with pytest.raises(ValueError):
            tier.path_for(bad)


def _file_size(root: Path, entry: object) -> int:
    probe = disk(root)
    probe.save(entry)  # type: ignore[arg-type]
    return probe.usage()[1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU"))])
def test_a_pool_views_host_copy_is_its_values_copied_a_contiguous_head_at_a_time(device):
    """The writer copies a group's KV, a strided view of the pool (each head's tokens contiguous,
    the heads apart), one contiguous piece at a time: what reaches the file is the view's values."""
    from gateway.kvcache.disk_format import contiguous_pieces, host_copies

    pool = torch.randn(4, 3, 50, 8, device=device)  # layers, kv heads, pool tokens, head dim
    view = pool[1, :, 10:30].unsqueeze(0)  # [1, heads, tokens, dim] as a stored group's layer
    assert contiguous_pieces(view) == [(0, 0), (0, 1), (0, 2)]
    assert contiguous_pieces(pool) == [()]
    copies = host_copies([view, pool[2]])
    assert [c.device.type for c in copies] == ["cpu", "cpu"] and all(c.is_contiguous() for c in copies)
    assert torch.equal(copies[0], view.cpu()) and torch.equal(copies[1], pool[2].cpu())


def test_quarantined_files_count_against_the_budget_and_give_way_first(tmp_path: Path) -> None:
    """Bad files moved aside for inspection used to sit outside the budget: a dir damaged again
    and again grew by up to 32 entries past `disk_budget_bytes`."""
    entries = [make_entry(list(range(i * 100, i * 100 + 40)), seed=i) for i in range(4)]
    probe = disk(tmp_path / "probe")
    probe.save(entries[0])
    file_bytes = probe.usage()[1]
    tier = DiskTier(tmp_path / "cache", int(2.5 * file_bytes), probe.identity)
    for entry in entries[:2]:
        tier.save(entry)
    for entry in entries[:2]:  # both damaged, then looked up: moved aside
        path = tier.path_for(entry.key.digest)
        path.write_bytes(path.read_bytes()[:-8])
        with pytest.raises(CacheFault):
            tier.load(entry.key)
    moved = [p.stat().st_size for p in (tmp_path / "cache" / "quarantine").iterdir()]
    assert len(moved) == 2 and tier.usage() == (0, sum(moved))
    for entry in entries[2:]:
        tier.save(entry)
    assert {r.digest for r in tier.records()} == {e.key.digest for e in entries[2:]}
    assert len(_quarantined(tmp_path / "cache")) == 0 and tier.usage()[1] <= tier.budget_bytes


def test_a_listing_shows_only_files_a_lookup_would_serve(tmp_path: Path) -> None:
    """A truncated file and a file copied under another entry's name were listed (pinnable, counted
    against the pinned budget) though a lookup quarantines them."""
    tier = disk(tmp_path)
    whole, cut, copied = (make_entry(list(range(i * 100, i * 100 + 40)), seed=i) for i in range(3))
    for entry in (whole, cut):
        tier.save(entry)
    data = tier.path_for(cut.key.digest).read_bytes()
    tier.path_for(cut.key.digest).write_bytes(data[:-100])
    tier.path_for(copied.key.digest).write_bytes(tier.path_for(whole.key.digest).read_bytes())
    assert [r.digest for r in tier.records()] == [whole.key.digest]
    for entry in (cut, copied):
        with pytest.raises(CacheFault):
            tier.load(entry.key)
