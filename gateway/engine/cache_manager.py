"""The KV cache manager: where a job's KV comes from and where it goes. It owns the lookups (the
prefix store's RAM and disk tiers, tool lists sharing a cached group's first tokens, an earlier
turn of the same conversation), the block pool's allocation with eviction, and what is kept after
(a computed group stored, a finished prompt kept as its conversation's record).

`admit` answers a job with a `Placement` (its blocks, reserved; what to copy in is copied), or
`HOLD` (not now: the pool is full of blocks in use, or another sequence is computing the same
group). A warm-up has its own path, `place_group`: its group's run, HOLD, or None when the group
is cached already (its future resolved then; else when `store_group` stores it). Placing is "can I
place it?" (`can_place`: the blocks free plus those eviction could free; no, and the job waits
without evicting anything), then "place it" (`allocate`: a run of consecutive blocks, evicting
conversation records, then cached groups least recently used first; None when no run is found,
and the job waits); `held_for_blocks` says whether the last HOLD was for blocks. A sequence
preempted by recompute gets a run of the same size again through `place_own`, the same two steps.
tests/engine/test_cache_manager.py pins the order. Engine thread only.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Final

from gateway.engine.events import CacheResult, Job, WarmGroup
from gateway.engine.prefix_index import Conversations, GroupIndex, Record, chain_hashes, chunk_ends
from gateway.engine.sequence import Phase, Sequence
from gateway.kvcache.block_pool import BlockPool, BlockRun
from gateway.kvcache.entry import CacheEntry, CacheIdentity, PrefixKey
from gateway.kvcache.pins import Level
from gateway.kvcache.store import PrefixStore


class Hold(enum.Enum):
    HOLD = "hold"


HOLD: Final = Hold.HOLD  # the job cannot be admitted yet; it stays held and is tried again next step


@dataclass(slots=True)
class Placement:
    """A job's KV, reserved: the group segment `[0, group_len)` (a stored entry it reads, or a run
    it computes into) and its own run, which may start with a copied earlier turn."""

    group_len: int
    result: CacheResult
    own_run: BlockRun
    ends: list[int]
    key: PrefixKey | None = None
    entry: CacheEntry | None = None
    group_run: BlockRun | None = None
    tier: str | None = None
    group_from: int = 0  # group tokens copied from a cached group with the same first tokens
    rest_from: int = 0  # where the own prompt's computing starts (after a copied earlier turn)
    record: Record | None = None
    chain: list[bytes] = field(default_factory=list)
    lookup_s: float = 0.0
    admitted_at: float = field(default_factory=time.perf_counter)

    @property
    def reused(self) -> int:
        """Prompt tokens whose KV came from the cache (the answer's cached_tokens)."""
        return (self.group_len if self.entry is not None else self.group_from) + self.rest_from - self.group_len


class KVCacheManager:
    def __init__(self, store: PrefixStore, pool: BlockPool, identity: CacheIdentity, *, chunk_tokens: int,
                 min_prefix_tokens: int, turn_opening: tuple[int, ...] = (), conversation_reuse: bool = True,
                 pool_only: bool = False) -> None:
        self.store = store
        self.pool = pool
        self.identity = identity
        self.chunk_tokens = chunk_tokens
        self.min_prefix_tokens = min_prefix_tokens
        self.turn_opening = turn_opening  # where prompt chunks are cut (prefix_index.py)
        self.conversation_reuse = conversation_reuse  # keep finished prompts' KV for the next turn, and use it
        self.pool_only = pool_only  # the kernels read only the pool: a disk entry must be placed in it
        self.conversations = Conversations(pool.block_tokens)
        self.groups = GroupIndex(pool.block_tokens, chunk_tokens, store.ram.holds)
        self.compiling: dict[str, Sequence] = {}  # group digest -> the sequence computing it
        self.held_for_blocks = False  # the last `admit` answered HOLD because its blocks do not fit now
        self.warming: dict[str, WarmGroup] = {}  # group digest -> the warm-up computing it
        self.query_tokens = 0
        self.hit_tokens = 0
        self.conversation_hit_tokens = 0

    def key_for(self, prefix_ids: list[int], salt: str = "") -> PrefixKey:
        identity = self.identity if not salt else CacheIdentity(
            self.identity.model_fingerprint, self.identity.tokenizer_fingerprint,
            self.identity.adapter_version, salt)
        return PrefixKey.of(identity, prefix_ids)

    def blocks_needed(self, job: Job) -> int:
        return self.pool.blocks_for(job.prefix_len) + self.pool.blocks_for(
            len(job.prompt_ids) - job.prefix_len + job.params.max_tokens)

    def cached_blocks(self) -> int:
        held = sum(self.pool.blocks_for(e.num_tokens) for e in self.store.ram.entries() if e.blocks is not None)
        return held + self.conversations.num_blocks

    # ---- admission ---------------------------------------------------------------------------

    def admit(self, job: Job, recompute: bool = False) -> Placement | Hold:
        """Where `job`'s KV comes from, with its blocks reserved; `recompute`: its cached group was
        bad, compute it privately."""
        admitted = time.perf_counter()
        self.held_for_blocks = False
        prompt = job.prompt_ids
        cacheable = self.min_prefix_tokens <= job.prefix_len < len(prompt)
        group_len = job.prefix_len if cacheable else 0
        key: PrefixKey | None = None
        entry: CacheEntry | None = None
        tier: str | None = None
        result: CacheResult = "bypass" if not job.use_cache else "skip"
        if cacheable and job.use_cache and not recompute:
            key = self.key_for(prompt[:group_len], job.salt)
            if job.retention_s:  # before the lookup: the group is kept whether found or computed
                self.store.retain(key.digest, job.retention_s, job.tenant)  # within the tenant's share
            if key.digest in self.compiling:
                return HOLD
            found = self._lookup(key, job.salt)
            if found is HOLD:
                return HOLD
            if found is not None:
                entry, tier = found
            result = "hit" if entry is not None else "miss"
        elif recompute:
            result = "miss"
        ends = chunk_ends(prompt, group_len, self.chunk_tokens, self.turn_opening)
        chain: list[bytes] = []
        record, rest_from = None, group_len
        source: CacheEntry | None = None
        group_from = 0
        if job.use_cache and not recompute:
            if self.conversation_reuse:  # the chain also keys this request's own record when it ends
                chain = chain_hashes(self._conversation_root(job, group_len), prompt, self.pool.block_tokens)
                record, rest_from = self.conversations.find_turn(prompt, group_len, ends, chain)
            if group_len and entry is None:
                source, group_from = self.groups.longest(self._group_root(job.salt), prompt[:group_len])
        lookup_s = time.perf_counter() - admitted
        own_tokens, group_tokens = len(prompt) - group_len + job.params.max_tokens, group_len if entry is None else 0
        if not self.can_place(own_tokens, group_tokens):  # "can I place it?", before evicting anything
            if entry is not None:
                self.let_go(entry)
            self.held_for_blocks = True
            return HOLD
        # Hold the blocks to copy from while allocating: making room may evict their holders.
        held = [r for r in (record.run if record else None, source.blocks if source else None) if r is not None]
        for run in held:
            run.retain()
        try:
            runs = self._allocate_runs(own_tokens, group_tokens)
            if runs is None:
                if entry is not None:
                    self.let_go(entry)
                self.held_for_blocks = True
                return HOLD
            own_run, group_run = runs
            if record is not None and rest_from > group_len:
                own_run.copy_from(record.run, rest_from - group_len)
            if group_run is not None and source is not None and source.blocks is not None and group_from:
                group_run.copy_from(source.blocks, group_from)
        finally:
            for run in held:
                run.release()
        placement = Placement(group_len, result, own_run, ends, key=key, entry=entry, group_run=group_run, tier=tier,
                              group_from=group_from, rest_from=rest_from, record=record, chain=chain,
                              lookup_s=lookup_s, admitted_at=admitted)
        if job.use_cache:
            self.query_tokens += len(prompt)
            self.hit_tokens += placement.reused
            self.conversation_hit_tokens += rest_from - group_len
        return placement

    def place_group(self, warm: WarmGroup) -> Placement | Hold | None:
        """A warm-up's group run, reserved (its sequence computes the group, then ends); None when
        the group is cached already (the warm-up's future has it)."""
        key = warm.key
        if key.digest in self.compiling:
            return HOLD
        found = self.store.lookup(key)
        if found is not None:
            warm.future.set_result((found.entry, True))
            return None
        runs = self._allocate_runs(1, len(key.token_ids)) if self.can_place(1, len(key.token_ids)) else None
        if runs is None:
            return HOLD
        self.warming[key.digest] = warm
        ends = chunk_ends(key.token_ids, len(key.token_ids), self.chunk_tokens, self.turn_opening)
        return Placement(len(key.token_ids), "miss", runs[0], ends, key=key, group_run=runs[1],
                         rest_from=len(key.token_ids))

    def place_own(self, seq: Sequence) -> bool:
        """Give a sequence preempted by recompute its own run again, the size it had (the rest of
        its prompt and `max_tokens`); False when it does not fit now (nothing is evicted then)."""
        tokens = len(seq.prompt) - seq.group_len + seq.job.params.max_tokens
        run = self.allocate(tokens) if self.can_place(tokens) else None
        if run is None:
            return False
        seq.place(run)
        return True

    def _lookup(self, key: PrefixKey, salt: str) -> tuple[CacheEntry, str] | Hold | None:
        """The stored group, with a reference and a lock held for the sequence; None on a miss."""
        found = self.store.lookup(key)
        if found is None:
            return None
        entry = found.entry
        entry.touch()
        if entry.blocks is None:  # read from disk: copy it into the pool (when there is room)
            entry = self._place(entry, salt)
            if entry.blocks is None and self.pool_only:
                return HOLD  # the kernels read only the pool: wait until there is room for it
        else:
            entry.retain()
        self.store.lock(entry)
        return entry, found.tier

    def _place(self, loaded: CacheEntry, salt: str) -> CacheEntry:
        run = self.allocate(loaded.num_tokens)
        if run is None:
            return loaded  # used from its own tensors this once
        for index, layer in enumerate(loaded.layers):
            run.keys(index, 0, loaded.num_tokens).copy_(layer.keys[0])
            run.values(index, 0, loaded.num_tokens).copy_(layer.values[0])
        entry = CacheEntry(key=loaded.key, layers=run.entry_layers(loaded.num_tokens), group_id=loaded.group_id,
                           tool_names=loaded.tool_names, compile_s=loaded.compile_s,
                           created_at=loaded.created_at, last_used_at=loaded.last_used_at, hits=loaded.hits,
                           blocks=run)
        self.store.keep_in_ram(entry)  # replaces the loaded copy; the run's reference is the sequence's
        self.groups.add(entry, self._group_root(salt))
        return entry

    def can_place(self, own_tokens: int, group_tokens: int = 0) -> bool:
        """Whether a job's own run and its group's run could be placed now, counting the blocks
        `allocate` may free (conversation records, cached groups no running sequence holds). False
        only when they cannot: a job that must wait evicts nothing for it. True promises no free
        run of consecutive blocks: `allocate` answers that (None when the free blocks are apart)."""
        self.pool.reclaim()
        ram = self.store.ram
        unused = sum(entry.blocks.count for entry in ram.entries()
                     if entry.blocks is not None and not ram.in_use(entry.key.digest))
        need = self.pool.blocks_for(max(own_tokens, 1)) + (self.pool.blocks_for(group_tokens) if group_tokens else 0)
        return need <= self.pool.num_free + self.conversations.num_blocks + unused

    def _allocate_runs(self, own_tokens: int, group_tokens: int) -> tuple[BlockRun, BlockRun | None] | None:
        """The sequence's own run and (when it computes its group) the group's run; None when they
        do not both fit now."""
        own_run = self.allocate(own_tokens)
        if own_run is None or not group_tokens:
            return None if own_run is None else (own_run, None)
        group_run = self.allocate(group_tokens, held_blocks=own_run.count)
        if group_run is None:
            own_run.release()
            return None
        return own_run, group_run

    def allocate(self, tokens: int, held_blocks: int = 0) -> BlockRun | None:
        """A run for `tokens`, making room by dropping conversation records, then cached groups
        nobody uses (least recently used first). Retained, then pinned groups go (from RAM only)
        when nothing else is left and waiting would not help: no block is held but the cache's
        (and `held_blocks`, the caller's own), so no running request will give any back."""
        while (run := self.pool.allocate(tokens)) is None:
            if self.conversations.evict_oldest() or self.store.evict_oldest():
                continue
            if self.pool.num_used - held_blocks > self.cached_blocks() or \
                    not self.store.evict_oldest(up_to=Level.PINNED):
                return None
        return run

    def let_go(self, entry: CacheEntry) -> None:
        self.store.unlock(entry)
        entry.release()

    # ---- what is kept ------------------------------------------------------------------------

    def start_compiling(self, seq: Sequence) -> None:
        if seq.result == "miss" and seq.key is not None and seq.group_run is not None:
            self.compiling[seq.key.digest] = seq

    def store_group(self, seq: Sequence) -> CacheEntry:
        """The group `seq` computed, stored (RAM, and the disk tier behind it) and indexed."""
        assert seq.key is not None and seq.group_run is not None
        self.compiling.pop(seq.key.digest, None)
        job = seq.job
        entry = CacheEntry(key=seq.key, layers=seq.group_run.entry_layers(len(seq.key.token_ids)),
                           group_id=job.group_id, tool_names=job.tool_names, compile_s=seq.compile_s,
                           blocks=seq.group_run)
        self.store.insert(entry)
        self.groups.add(entry, self._group_root(job.salt))
        warm = self.warming.pop(seq.key.digest, None)
        if warm is not None:
            warm.future.set_result((entry, False))
        return entry

    def keep_turn(self, seq: Sequence) -> None:
        """Index the prompt KV of a finished sequence for its conversation's next turn. Only the
        prompt: the generated tokens' KV came from decode passes, and the next turn's prompt would
        compute them in a prefill chunk, with other bits (engine/prefix_index.py)."""
        job = seq.job
        own_tokens = len(seq.prompt) - seq.group_len
        if not self.conversation_reuse or not job.use_cache or seq.phase is not Phase.DECODE or own_tokens <= 0 \
                or seq.own_run is None:
            return
        record = Record(tuple(seq.prompt), seq.group_len, frozenset(seq.ends), seq.own_run.head(own_tokens),
                        seq.chain)
        self.conversations.add(record, replaces=seq.source)

    def retire(self, seq: Sequence) -> None:
        """What the cache holds for `seq` is let go: the compile it owned, the entry it read."""
        if seq.key is not None and self.compiling.get(seq.key.digest) is seq:
            del self.compiling[seq.key.digest]
            self.warming.pop(seq.key.digest, None)  # a failed warm-up hears why through its job's events
        if seq.entry is not None and seq.result == "hit":
            self.store.unlock(seq.entry)

    def quarantine(self, entry: CacheEntry, why: str) -> None:
        self.store.quarantine(entry, "nonfinite", why)

    # ---- roots of the chains ------------------------------------------------------------------

    def _conversation_root(self, job: Job, group_len: int) -> bytes:
        """The root of a prompt's block chain: identity, the tenant's namespace, the group's length
        (it decides where the chunks are cut)."""
        return self.identity.digest_bytes() + f"\x00conversation\x00{job.tenant}\x00{group_len}".encode()

    def _group_root(self, salt: str) -> bytes:
        return self.key_for([], salt).digest.encode()
