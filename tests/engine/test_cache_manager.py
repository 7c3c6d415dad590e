"""The KV cache manager without a model (gateway/engine/cache_manager.py), in the manner of vLLM's
tests/v1/core/test_prefix_caching.py: a real block pool of 8 blocks of 4 tokens, a real prefix
store, and jobs whose tool groups are 2 blocks. The tests pin where a job's blocks go (first fit:
its own run, then its group's run) and the exact order in which cached groups are evicted when
the pool is full (conversation records first, then groups least recently used first; a group in
use never)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import pytest
import torch

from gateway.engine.cache_manager import HOLD, KVCacheManager, Placement
from gateway.engine.events import Failed, Job, WarmGroup, WarmUpFailed
from gateway.engine.sampling import SamplingParams
from gateway.engine.sequence import Phase, Sequence
from gateway.kvcache.block_pool import BlockPool, BlockRun, PoolShape, RamTier
from gateway.kvcache.entry import CacheIdentity, PrefixKey
from gateway.kvcache.store import PrefixStore

SHAPE = PoolShape(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32)
BLOCK_TOKENS = 4
GROUP = 8  # tokens: two blocks


def manager(num_blocks: int = 8, conversation_reuse: bool = False) -> KVCacheManager:
    pool = BlockPool(SHAPE, num_blocks * BLOCK_TOKENS * SHAPE.bytes_per_token, BLOCK_TOKENS, torch.device("cpu"))
    store = PrefixStore(RamTier(1 << 30))
    return KVCacheManager(store, pool, CacheIdentity("model", "tokenizer", "test"), chunk_tokens=128,
                          min_prefix_tokens=4, conversation_reuse=conversation_reuse)


def job(group: int, rest: int = 2, max_tokens: int = 2) -> Job:
    """A job whose tool group is `GROUP` tokens all equal to `group` (one group per value)."""
    return Job([group] * GROUP + [100 + i for i in range(rest)], GROUP, SamplingParams(max_tokens=max_tokens))


@dataclass
class Compiled:
    """What storing a group reads of the sequence that computed it."""

    job: Job
    key: PrefixKey | None
    group_run: BlockRun | None
    own_run: BlockRun
    compile_s: float = 0.0
    result: str = "miss"
    entry: object = None


def admitted(cache: KVCacheManager, made: Job) -> Placement:
    placement = cache.admit(made)
    assert isinstance(placement, Placement)
    return placement


def compile_and_finish(cache: KVCacheManager, made: Job) -> None:
    """Admit `made` (a miss), store its group as its last chunk would, and retire it."""
    placed = admitted(cache, made)
    assert placed.result == "miss" and placed.group_run is not None
    seq = cast(Sequence, Compiled(made, placed.key, placed.group_run, placed.own_run))
    cache.store_group(seq)
    cache.retire(seq)
    placed.own_run.release()
    placed.group_run.release()


def hit_and_finish(cache: KVCacheManager, made: Job, placed: Placement | None = None) -> None:
    """Admit `made` (a hit; or take its `placed` hit, running) and retire it."""
    placed = placed or admitted(cache, made)
    assert placed.result == "hit" and placed.entry is not None and placed.entry.blocks is not None
    cache.retire(cast(Sequence, Compiled(made, placed.key, None, placed.own_run, result="hit", entry=placed.entry)))
    placed.own_run.release()
    placed.entry.blocks.release()


def cached_groups(cache: KVCacheManager) -> list[int]:
    """The groups in RAM, least recently used first, by their token value."""
    return [entry.key.token_ids[0] for entry in cache.store.ram.entries()]


def test_a_miss_takes_its_own_run_then_its_groups_first_fit() -> None:
    cache = manager()
    placed = admitted(cache, job(1, rest=2, max_tokens=2))  # own: 2 + 2 tokens, one block
    assert placed.group_run is not None
    assert (list(placed.own_run.block_ids), list(placed.group_run.block_ids)) == ([0], [1, 2])
    assert cache.pool.num_used == 3 and placed.reused == 0


def test_cached_groups_are_evicted_least_recently_used_first_and_a_group_in_use_never() -> None:
    cache = manager()
    for group in (1, 2, 3):
        compile_and_finish(cache, job(group))
    assert cached_groups(cache) == [1, 2, 3] and cache.pool.num_used == 6
    hit_and_finish(cache, job(1))  # 1 is now the most recently used
    assert cached_groups(cache) == [2, 3, 1]
    held = admitted(cache, job(3))  # a hit on 3, still running: 3 is in use
    assert held.result == "hit" and cache.pool.num_used == 7
    placed = admitted(cache, job(4))  # its own block is the free 7th; its group takes 2's blocks
    assert cached_groups(cache) == [1, 3] and placed.result == "miss"
    assert placed.group_run is not None and list(placed.group_run.block_ids) == [3, 4]
    assert not cache.can_place(2 + 2, GROUP)  # 3 blocks; 1's 2 are all that could be freed
    assert cache.admit(job(5)) is HOLD and cached_groups(cache) == [1, 3]  # nothing evicted for a job that waits
    hit_and_finish(cache, job(3), held)  # 3 is no longer in use: 4 blocks could be freed
    assert cache.can_place(2 + 2, GROUP)
    placed = admitted(cache, job(5))  # its own block is 3's hit's, freed; its group takes 1's blocks
    assert placed.group_run is not None and list(placed.group_run.block_ids) == [1, 2]
    assert cached_groups(cache) == [3] and cache.pool.num_used == 8


def test_a_hit_reuses_the_groups_blocks_and_counts_its_tokens() -> None:
    cache = manager()
    compile_and_finish(cache, job(7))
    placed = admitted(cache, job(7, rest=3))
    assert placed.result == "hit" and placed.group_run is None and placed.entry is not None
    assert placed.entry.blocks is not None and list(placed.entry.blocks.block_ids) == [1, 2]
    assert placed.reused == GROUP and (cache.query_tokens, cache.hit_tokens) == (GROUP + 2 + GROUP + 3, GROUP)


def test_a_group_being_computed_holds_the_next_job_with_it() -> None:
    cache = manager()
    placed = admitted(cache, job(1))
    seq = cast(Sequence, Compiled(job(1), placed.key, placed.group_run, placed.own_run))
    seq.phase = Phase.GROUP
    cache.start_compiling(seq)
    assert cache.admit(job(1)) is HOLD  # it waits for the compile rather than computing it twice


def test_a_warm_up_computes_its_group_once_then_finds_it_cached() -> None:
    cache = manager()
    key = cache.key_for([9] * GROUP)
    first = WarmGroup(key, "g")
    placed = cache.place_group(first)  # a miss: a 1-token own run, then the group's run, first fit
    assert isinstance(placed, Placement) and placed.group_run is not None and placed.result == "miss"
    assert (list(placed.own_run.block_ids), list(placed.group_run.block_ids)) == ([0], [1, 2])
    seq = cast(Sequence, Compiled(first.job, placed.key, placed.group_run, placed.own_run))
    cache.start_compiling(seq)
    assert cache.place_group(WarmGroup(key)) is HOLD  # the same group, being computed: it waits
    assert not first.future.done()
    entry = cache.store_group(seq)
    assert first.future.result(timeout=0) == (entry, False)
    again = WarmGroup(key)
    assert cache.place_group(again) is None and again.future.result(timeout=0) == (entry, True)
    assert cached_groups(cache) == [9] and cache.pool.num_used == 3  # nothing placed for the second


def test_a_warm_up_whose_compute_fails_hears_why_and_frees_its_group_for_another_try() -> None:
    cache = manager()
    warm = WarmGroup(cache.key_for([9] * GROUP))
    placed = cache.place_group(warm)
    assert isinstance(placed, Placement) and placed.group_run is not None
    seq = cast(Sequence, Compiled(warm.job, placed.key, placed.group_run, placed.own_run))
    cache.start_compiling(seq)
    cache.retire(seq)  # as a failed row is retired (outputs.fail), then its job hears why
    placed.own_run.release()
    placed.group_run.release()
    warm.job.emit(Failed("generation failed (RuntimeError); the server log has the details"))
    with pytest.raises(WarmUpFailed, match="RuntimeError"):
        warm.future.result(timeout=0)
    retry = WarmGroup(warm.key)
    assert isinstance(cache.place_group(retry), Placement) and cache.pool.num_used == 3  # not held by the failed one
