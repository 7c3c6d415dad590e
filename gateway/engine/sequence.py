"""A sequence: one request inside the engine, from admission to its last token.

Its KV is two segments (see model_runner): the tool group `[0, group_len)`, either shared from the
prefix store (a hit) or computed by this sequence into a run of its own (a miss stores that run; a
bypass keeps it private; a new tool list may start it from a cached group's first tokens), and its
own run after it, reserved at admission for the rest of the prompt plus `max_tokens`, so a running
sequence never needs another block. The own run may start with an earlier turn's KV, copied in.
Its prompt is computed in the chunks `ends` gives (engine/prefix_index.py), from `computed` on.

A decoding sequence may be preempted by recompute (`preempt`: the scheduler gives its blocks to
another tenant's request, scheduler.py): its own run goes back to the pool, and when it is placed
again (the same size) it prefills its prompt and the tokens it had fed the model (`RECOMPUTE`,
the prompt cut as `ends` cut it the first time) and decodes on from its `pending` tokens. Its
sampler, grammar, text and logprobs are kept as they were: no token is sampled, followed by the
grammar or emitted twice. The group segment it reads or wrote stays held.

Its text (`TextStream`, `HeldLogprobs`): what its tokens write, in deltas that are final (whole
characters, never the start of a stop sequence that may still match), and the logprobs of each
token held until its text is sent.

A token's text is found incrementally, by the tokenizers library's `DecodeStream` (Rust: under a
microsecond a token), not by decoding every token so far again (transformers' `decode`: ~100 µs
a token at 600 tokens on the development CPU, growing with the answer, for every row of every
step: 32 rows of long answers cost more host time a step than an 8B model's decode step on an
H100). The text is the same: a stream steps through the tokens `decode` would decode, with the
same `skip_special_tokens`; a character split across tokens comes when it is complete, as before.
Tokenizers without a Rust backend, those whose `decode` cleans up spaces afterwards (a pass no
stream does), and a stream that fails ("invalid prefix") decode every token again instead.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from tokenizers.decoders import DecodeStream

from gateway.engine.events import CacheResult, Job, TextDelta
from gateway.engine.model_runner import RowKV
from gateway.engine.prefix_index import Record, next_end
from gateway.engine.sampling import Sampler, TokenLogprob
from gateway.engine.stats import DeviceSpan
from gateway.engine.tokenizer import Tokenizer
from gateway.kvcache.block_pool import BlockRun
from gateway.kvcache.entry import CacheEntry, PrefixKey

if TYPE_CHECKING:  # the cache manager makes sequences' placements and keeps sequences
    from gateway.engine.cache_manager import Placement


# ---- the text a sequence's tokens write ------------------------------------------------------

class HeldLogprobs:
    """A sequence's token logprobs, each held until the text its token wrote has been sent: a
    delta carries the logprobs of the tokens whose text ends in it. A stop sequence cuts the
    text: the tokens that wrote some of what was sent go with the last delta, the others are
    dropped (their text never reaches the client)."""

    def __init__(self) -> None:
        self._held: list[tuple[int, int, TokenLogprob]] = []  # (text start, text end, entry)
        self._end = 0

    def hold(self, entry: TokenLogprob, text_end: int) -> None:
        self._held.append((self._end, text_end, entry))
        self._end = text_end

    def release(self, sent_chars: int | None, cut: bool = False) -> tuple[TokenLogprob, ...]:
        """Those whose text is within the first `sent_chars` characters (None: all); `cut`: those
        whose text starts there, and none is held any more."""
        if not self._held:
            return ()
        if sent_chars is None or cut:
            limit = len(self._held) if sent_chars is None else sum(
                1 for start, end, _ in self._held if start < sent_chars or end <= sent_chars)
            taken, self._held = self._held[:limit], []
        else:
            limit = next((i for i, (_, end, _) in enumerate(self._held) if end > sent_chars), len(self._held))
            taken, self._held = self._held[:limit], self._held[limit:]
        return tuple(entry for _, _, entry in taken)


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class TextStream:
    """Accumulates generated tokens; yields only text that is final (complete characters, and not
    possibly the start of a stop sequence). `stopped` turns true once a stop sequence appears;
    `stopped_by` is that sequence (the first in the text; of two at one place, the first listed).

    `stop_before`: stop sequences match only in the text before it (a tool call section's
    trigger: the calls after it are held to their schemas by the grammar, and a stop sequence
    would cut them into invalid arguments); "" for none of the text. A stop sequence that runs
    into the trigger itself (`"<tool"` before `<tool_call>`) stops the text when it is found
    before the trigger is whole, which depends on how the tokens split them.
    """

    def __init__(self, decoder: Decoder, stop: tuple[str, ...],
                 special_ids: frozenset[int] = frozenset(), keep_ids: frozenset[int] = frozenset(),
                 stop_before: str | None = None) -> None:
        self.decoder = decoder
        self.stop = stop if stop_before != "" else ()
        self.stop_before = stop_before or None
        self.calls_from: int | None = None  # where the text's call section starts, once written
        self._scanned = 0  # the text searched for it so far
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.emitted_chars = 0
        self.text_chars = 0  # where the text written so far ends: a character begun counts as written
        self.stopped = False
        self.stopped_by: str | None = None
        # Special tokens are dropped from the text, except the family's tool-call markers (a
        # Mistral model writes `[TOOL_CALLS]` as one special token, and the parser needs it).
        self.keep_ids = keep_ids
        self.hidden_ids = special_ids - keep_ids
        self._visible: list[int] = []
        self._backend = _stream_backend(decoder)  # None: every token decodes the whole text again
        self._stream = DecodeStream(skip_special_tokens=not keep_ids) if self._backend is not None else None
        self._text = ""  # the text of the tokens so far, whole characters only (text_chars: and one begun)
        self._anchor: int | None = None  # the last token that wrote text
        self._held: list[int] = []  # the tokens after it, that have written nothing yet

    def push(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        if token_id not in self.hidden_ids:
            self._visible.append(token_id)
            self._step(token_id)
        text = self._text
        if self._pending:
            return ""  # a multi-byte character is not complete yet
        end = self._stop_at(text)
        if end is not None:
            self.stopped = True
            return self._take(text, end)
        if self.calls_from is not None:  # no stop sequence can match any more: all of it is final
            return self._take(text, len(text))
        return self._take(text, len(text) - self.holdback)

    def flush(self) -> str:
        if self.stopped:
            return ""
        text = self._decoded() if self._pending else self._text  # a character never completed: as decode writes it
        return self._take(text, len(text))

    def _step(self, token_id: int) -> None:
        """The text with `token_id`'s (a token the text shows: not a hidden special token)."""
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:  # the stream cannot go on (e.g. "invalid prefix"): decode whole from now on
                self._stream = None
            else:
                if piece is not None:
                    self._text += piece
                    self._anchor, self._held = token_id, []
                    self.text_chars = len(self._text)
                    return
                self._held.append(token_id)  # no text yet: the token's bytes end inside a character
                written = self._written_with_held()
                if written is not None:
                    self.text_chars = written
                    return
                self._stream = None
        text = self._decoded()
        self._text = text.rstrip("\ufffd")
        self.text_chars = _written_chars(text)

    @property
    def _pending(self) -> bool:
        """The last tokens began a character that is not complete yet."""
        return self.text_chars > len(self._text)

    def _written_with_held(self) -> int | None:
        """Where the text ends with the held tokens, as decoding every token counts it: the
        stream holds them, and any whole characters they begin with (a space before an emoji's
        first bytes), until their last character is complete. Counted from the decoding of the
        last token that wrote text and them, past that token's own text (None: they do not
        decode after it)."""
        skip = not self.keep_ids
        if self._anchor is None:
            return _written_chars(self._backend.decode(self._held, skip_special_tokens=skip))
        anchor = self._backend.decode([self._anchor], skip_special_tokens=skip)
        both = self._backend.decode([self._anchor, *self._held], skip_special_tokens=skip)
        if not both.startswith(anchor):
            return None
        return len(self._text) + _written_chars(both[len(anchor):])

    def _decoded(self) -> str:
        """Every token so far, decoded at once (a character not complete yet as U+FFFD)."""
        if not self.keep_ids:
            return self.decoder.decode(self.token_ids, skip_special_tokens=True)
        return self.decoder.decode(self._visible, skip_special_tokens=False)

    def _stop_at(self, text: str) -> int | None:
        if not self.stop:
            return None
        start = max(0, self.emitted_chars - self.holdback)
        if self.stop_before is not None and self.calls_from is None:  # a trigger may end in the new text
            at = text.find(self.stop_before, max(0, self._scanned - len(self.stop_before) + 1))
            self.calls_from, self._scanned = (at if at >= 0 else None), len(text)
        end = len(text) if self.calls_from is None else self.calls_from  # a match must end before the calls
        hits = [(i, n) for n, i in enumerate(text.find(s, start, end) for s in self.stop) if i >= 0]
        if not hits:
            return None
        at, which = min(hits)
        self.stopped_by = self.stop[which]
        return at

    def _take(self, text: str, end: int) -> str:
        if end <= self.emitted_chars:
            return ""
        delta = text[self.emitted_chars : end]
        self.emitted_chars = end
        return delta


def _written_chars(text: str) -> int:
    """Where `text` ends; a character not complete yet (decoded as U+FFFD) counts as written: the
    token that began it ends inside it, and is sent with it."""
    complete = text.rstrip("\ufffd")
    return len(complete) + (complete != text)


def _stream_backend(decoder: Decoder) -> Any:
    """The Rust tokenizer a `DecodeStream` steps with, when its text is `decoder.decode`'s: None
    for a tokenizer without one, or one whose `decode` cleans up spaces after decoding."""
    if getattr(decoder, "clean_up_tokenization_spaces", False):
        return None
    return getattr(decoder, "backend_tokenizer", None)


# ---- the sequence -------------------------------------------------------------------------------

class Phase(enum.Enum):
    GROUP = "group"  # computing the tool group's KV into `group_run`
    PROMPT = "prompt"  # prefilling the rest of the prompt into `own_run`
    RECOMPUTE = "recompute"  # prefilling again its prompt and the tokens it had fed (after `preempt`)
    DECODE = "decode"


@dataclass(slots=True)
class Sequence:
    job: Job
    group_len: int  # tokens in the group segment (0: none)
    result: CacheResult
    own_run: BlockRun | None  # None while preempted by recompute
    ends: list[int]  # where the prompt's chunks end (prefix_index.chunk_ends)
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
    recompute_ids: list[int] = field(default_factory=list)  # RECOMPUTE: the prompt and the tokens fed before
    recompute_ends: list[int] = field(default_factory=list)  # RECOMPUTE: where its chunks end
    preempted_at: int = -1  # `generated` when it was last preempted by recompute (-1: never)
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
    def prefill_ids(self) -> list[int]:
        """The tokens its prefill computes: the prompt, or (RECOMPUTE) with the tokens fed before."""
        return self.recompute_ids if self.phase is Phase.RECOMPUTE else self.job.prompt_ids

    @property
    def remaining_prefill(self) -> int:
        return len(self.prefill_ids) - self.computed if self.phase is not Phase.DECODE else 0

    @property
    def own_blocks(self) -> int:
        """The blocks a recompute preemption would give back (its own run's)."""
        return self.own_run.count if self.own_run is not None else 0

    @property
    def recomputable(self) -> bool:
        """Whether it may be preempted by recompute: decoding, with its blocks, every token taken
        in its text, and a token taken since it was last preempted (so it always moves on)."""
        return self.phase is Phase.DECODE and self.own_run is not None and self.generated > self.preempted_at \
            and len(self.stream.token_ids) == self.generated

    def preempt(self, chunk_tokens: int) -> None:
        """Give its own run back (module doc): the tokens fed to the model so far join the prompt
        to prefill again once it is placed again (`place`); those taken and not fed (`pending`)
        stay pending. Its sampler, grammar, text and logprobs are untouched."""
        assert self.recomputable and self.own_run is not None
        self.own_run.release()
        self.own_run = None
        tokens = self.stream.token_ids
        self.recompute_ids = [*self.job.prompt_ids, *tokens[:len(tokens) - len(self.pending)]]
        total, prompt_len = len(self.recompute_ids), len(self.job.prompt_ids)
        self.recompute_ends = [*self.ends, *range(prompt_len + chunk_tokens, total, chunk_tokens)]
        if total > prompt_len:
            self.recompute_ends.append(total)
        self.phase, self.computed, self.preempted_at = Phase.RECOMPUTE, self.group_len, self.generated

    def place(self, run: BlockRun) -> None:
        """Its own run again, after `preempt`: the recompute starts after the group."""
        self.own_run = run

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
        ends = self.recompute_ends if self.phase is Phase.RECOMPUTE else self.ends
        return self.computed, next_end(ends, self.computed)

    def row(self, new_tokens: int, ahead: int = 0) -> RowKV:
        """Where this sequence's next `new_tokens` go: the prompt's next chunk, or the `pending`
        tokens of a decoding one (`ahead`: a decode row that many tokens past the ones taken so
        far, for a step launched before the last one's token is read)."""
        if self.phase is Phase.GROUP:
            assert self.group_run is not None
            return RowKV(None, self.group_run, self.computed, self.computed)
        assert self.own_run is not None, "a sequence preempted by recompute is out of the batch"
        position = self.computed if self.phase is not Phase.DECODE else \
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
        if self.own_run is not None:
            self.own_run.release()
            self.own_run = None
        if self.group_run is not None:
            self.group_run.release()
            self.group_run = None
        if self.entry is not None and self.entry.blocks is not None and self.result == "hit":
            self.entry.blocks.release()
