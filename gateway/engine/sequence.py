"""A sequence: one request inside the engine, from admission to its last token.

Its KV is two segments (see model_runner): the tool group `[0, group_len)`, either shared from the
prefix store (a hit) or computed by this sequence into a run of its own (a miss stores that run; a
bypass keeps it private; a new tool list may start it from a cached group's first tokens), and its
own run after it, reserved at admission for the rest of the prompt plus `max_tokens`, so a running
sequence never needs another block. The own run may start with an earlier turn's KV, copied in.
Its prompt is computed in the chunks `ends` gives (engine/chunks.py), from `computed` on.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gateway.engine.chunks import next_end
from gateway.engine.events import CacheResult, Job, TextDelta
from gateway.engine.model_runner import RowKV
from gateway.engine.prefix_index import Record
from gateway.engine.sampling import Sampler
from gateway.engine.stats import DeviceSpan
from gateway.engine.text_stream import HeldLogprobs, TextStream
from gateway.engine.tokenizer import Tokenizer
from gateway.kvcache.block_pool import BlockRun
from gateway.kvcache.entry import CacheEntry
from gateway.kvcache.keys import PrefixKey

if TYPE_CHECKING:  # the cache manager makes sequences' placements and keeps sequences
    from gateway.engine.cache_manager import Placement


class Phase(enum.Enum):
    GROUP = "group"  # computing the tool group's KV into `group_run`
    PROMPT = "prompt"  # prefilling the rest of the prompt into `own_run`
    DECODE = "decode"


@dataclass(slots=True)
class Sequence:
    job: Job
    group_len: int  # tokens in the group segment (0: none)
    result: CacheResult
    own_run: BlockRun
    ends: list[int]  # where the prompt's chunks end (chunks.chunk_ends)
    sampler: Sampler
    stream: TextStream
    key: PrefixKey | None = None  # the group's key when it is looked up / stored
    entry: CacheEntry | None = None  # the stored group this sequence reads (a hit) or wrote (a miss)
    group_run: BlockRun | None = None  # the group's KV computed by this sequence (miss, bypass)
    tier: str | None = None
    phase: Phase = Phase.PROMPT
    computed: int = 0  # prompt tokens whose KV is in place
    reused: int = 0  # prompt tokens whose KV came from the cache (cached_tokens)
    generated: int = 0  # tokens sampled so far
    pending: list[int] = field(default_factory=list)  # taken (sampled, then any forced), not yet fed to the model
    admitted_at: float = field(default_factory=time.perf_counter)
    lookup_s: float = 0.0
    compile_started: float = 0.0
    compile_s: float = 0.0
    forward_s: float = 0.0  # the model's forward passes over this sequence's own prompt tokens
    forward_spans: list[DeviceSpan] = field(default_factory=list)  # those passes, timed on the device
    last_step: int = 0  # the scheduler's step that last ran it (0: none yet)
    chain: list[bytes] = field(default_factory=list)  # the prompt's block hashes (prefix_index)
    source: Record | None = None  # the conversation record its rest started from
    rest_from: int = 0  # where its own prompt tokens start being computed (after a copied turn)
    logprobs: HeldLogprobs = field(default_factory=HeldLogprobs)  # sampled, their text not sent yet
    _group_views: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def admitted(cls, job: Job, placed: Placement, tokenizer: Tokenizer, special_ids: frozenset[int]) -> Sequence:
        """The sequence of an admitted job, its KV where the cache manager placed it."""
        stream = TextStream(tokenizer, job.params.stop, special_ids, job.keep_token_ids, job.stop_before)
        sampler = Sampler(job.params, job.constraint)
        seq = cls(job, placed.group_len, placed.result, placed.own_run, placed.ends, sampler, stream,
                  key=placed.key, entry=placed.entry, group_run=placed.group_run, tier=placed.tier,
                  lookup_s=placed.lookup_s, chain=placed.chain, source=placed.record, rest_from=placed.rest_from,
                  admitted_at=placed.admitted_at, reused=placed.reused)
        if placed.group_run is not None:
            seq.phase = Phase.GROUP
            seq.computed = placed.group_from
            seq.compile_started = seq.admitted_at
        else:
            seq.computed = placed.rest_from
        return seq

    @property
    def prompt(self) -> list[int]:
        return self.job.prompt_ids

    @property
    def remaining_prefill(self) -> int:
        return len(self.prompt) - self.computed if self.phase is not Phase.DECODE else 0

    def group_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per layer, the group segment's keys and values `[kv_heads, G, dim]`."""
        if self.group_len == 0:
            return None
        if self._group_views is None:  # built once: every step of the sequence reads the same views
            self._group_views = self._build_group_views()
        return self._group_views

    def _build_group_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.group_run is not None:
            run = self.group_run
            return [(run.keys(i, 0, self.group_len), run.values(i, 0, self.group_len))
                    for i in range(len(run.pool.keys))]
        assert self.entry is not None
        return [(layer.keys[0], layer.values[0]) for layer in self.entry.layers]

    def next_chunk(self) -> tuple[int, int]:
        """The next prompt chunk `[start, end)`, as `ends` cuts the prompt whatever the schedule."""
        return self.computed, next_end(self.ends, self.computed)

    def row(self, new_tokens: int, ahead: int = 0) -> RowKV:
        """Where this sequence's next `new_tokens` go: the prompt's next chunk, or the `pending`
        tokens of a decoding one (`ahead`: a decode row that many tokens past the ones taken so
        far, for a step launched before the last one's token is read)."""
        if self.phase is Phase.GROUP:
            assert self.group_run is not None
            return RowKV(None, self.group_run, self.computed, self.computed)
        position = self.computed if self.phase is Phase.PROMPT else \
            len(self.prompt) + self.generated - len(self.pending) + ahead
        return RowKV(self.group_kv(), self.own_run, position - self.group_len, position, self.group_start)

    @property
    def group_start(self) -> int:
        """The pool token where the group's KV starts; -1 when it is not in the pool."""
        if self.group_run is not None:
            return self.group_run.token_start
        if self.entry is not None and self.entry.blocks is not None:
            return self.entry.blocks.token_start
        return -1

    def emit_text(self, text: str, sent_chars: int | None) -> None:
        """Send `text` (the answer is `sent_chars` characters long with it; None: all of it) with
        the logprobs of the tokens whose text it completes."""
        logprobs = self.logprobs.release(sent_chars, cut=self.stream.stopped)
        if text or logprobs:
            self.job.emit(TextDelta(text, logprobs, self.generated))

    def release(self) -> None:
        """Give back every block this sequence holds (its own run, the group it read or wrote)."""
        self.own_run.release()
        if self.group_run is not None:
            self.group_run.release()
            self.group_run = None
        if self.entry is not None and self.entry.blocks is not None and self.result == "hit":
            self.entry.blocks.release()
