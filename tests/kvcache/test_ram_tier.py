"""RAM tier: exact LRU order under a byte budget; entries in use are never evicted."""

from __future__ import annotations

import pytest
import torch

from gateway.kvcache.block_pool import RamTier
from gateway.kvcache.entry import CacheEntry, CacheIdentity, LayerKV, PrefixKey

pytestmark = pytest.mark.model_free  # no model, no server: in the fast subset

IDENTITY = CacheIdentity("model", "tok", "chatml-1")


def entry(n: int, num_floats: int = 250) -> CacheEntry:
    kv = torch.zeros(1, 1, num_floats, 1)  # 1000 bytes per tensor, 2000 per entry
    return CacheEntry(key=PrefixKey.of(IDENTITY, [n, n + 1]), layers=(LayerKV(kv, kv.clone()),),
                      group_id=f"g{n}", tool_names=())


def digests(tier: RamTier) -> list[str]:
    return [e.group_id for e in tier.entries()]


def test_evicts_least_recently_used_first_in_exact_order():
    tier = RamTier(budget_bytes=6000)
    a, b, c, d = entry(1), entry(2), entry(3), entry(4)
    for e in (a, b, c):
        tier.insert(e)
    assert tier.match(a.key) is a  # a becomes most recent: order b, c, a
    evicted = tier.insert(d)
    assert [ev.digest for ev in evicted] == [b.key.digest]
    assert digests(tier) == ["g3", "g1", "g4"]
    assert tier.num_bytes == 6000


def test_locked_entry_is_never_evicted():
    tier = RamTier(budget_bytes=4000)
    a, b, c = entry(1), entry(2), entry(3)
    tier.insert(a)
    tier.insert(b)
    tier.lock(a.key.digest)
    tier.insert(c)
    assert digests(tier) == ["g1", "g3"]
    tier.unlock(a.key.digest)
    tier.insert(entry(4))
    assert digests(tier) == ["g3", "g4"]


def test_when_everything_is_locked_the_new_entry_is_not_kept():
    tier = RamTier(budget_bytes=2000)
    a = entry(1)
    tier.insert(a)
    tier.lock(a.key.digest)
    tier.insert(entry(2))
    assert digests(tier) == ["g1"]


def test_entry_larger_than_the_budget_is_not_stored():
    tier = RamTier(budget_bytes=1000)
    assert tier.insert(entry(1)) == []
    assert len(tier) == 0


def test_match_requires_identical_token_ids_not_only_the_digest():
    tier = RamTier(budget_bytes=10_000)
    a = entry(1)
    tier.insert(a)
    forged = PrefixKey(digest=a.key.digest, token_ids=(9, 9))
    assert tier.match(forged) is None
    assert tier.match(a.key) is a
