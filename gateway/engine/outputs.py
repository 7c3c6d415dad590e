"""What a step's output does to each sequence it computed (engine thread only): a group's last
chunk stores the group, a prompt's last chunk sends `Prefilled` and takes the first token, a
decode row takes the next one (every row of a step is chosen on the device at once,
sampling.device_picks; the grammar masks come from `prepare_masks`); the grammar follows each
token, each token's text is emitted, and a sequence that
is done (end of sequence, a stop string, `max_tokens`) or fails is retired: out of the running
batch, its blocks back to the pool, before its client hears it is done.

A prompt whose cached group gives non-finite logits (a poisoned file passes its checksum when its
writer had write access) has the group dropped and is restarted with the group computed privately
(the engine admits it again); non-finite logits from a model by itself fail the request. A fault
in one sequence's output fails that sequence only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal

from gateway.engine.constraints import Constraint, GrammarLimit
from gateway.engine.events import CutOff, Failed, Finished, Job, Prefilled
from gateway.engine.sampling import NonFiniteLogits, Pick, Picks, TokenLogprob
from gateway.engine.scheduler import Scheduler
from gateway.engine.sequence import Phase, Sequence
from gateway.engine.stats import DeviceSpan

log = logging.getLogger("gateway.engine.core")  # the engine's logger, as before this module was split off


@dataclass(slots=True)
class StepOutput:
    """A step's forward, launched: its decode rows and prompt chunks, the prompts it finishes, and
    the picks of the rows it samples (chosen on the device, not read yet)."""

    decode: list[Sequence]
    prefill: list[tuple[Sequence, int, int]]
    finishing: set[int]  # ids of the prefill sequences whose last chunk this is
    sampled: list[Sequence]
    picks: Picks | None
    forward: DeviceSpan
    num_tokens: int


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, eos_ids: frozenset[int]) -> None:
        self.scheduler = scheduler  # the batch's owner: a sequence that is done leaves it there
        self.cache = scheduler.cache
        self.eos_ids = eos_ids
        self.constrained_tokens = 0
        self.constraint_s = 0.0
        self.forced_tokens = 0  # tokens a grammar forced (taken without a choice)
        self.chunk_forced = True  # forced tokens go to the model as one chunk (False: a step each)

    # ---- a step's rows -----------------------------------------------------------------------

    def update(self, out: StepOutput) -> None:
        """What the step's output does: the chunks are computed (a group's last one stores it), then
        the picks are read; a prompt's last chunk takes its first token, a decode row its next."""
        for seq, _, end in out.prefill:
            self.chunk_done(seq, end, out.forward)
        read = out.picks.read() if out.picks is not None else []
        picked = dict(zip((id(seq) for seq in out.sampled), read, strict=True))
        for seq, _, _ in out.prefill:
            if id(seq) in out.finishing and id(seq) in picked:
                self.prompt_done(seq, picked[id(seq)])
        for seq in out.decode:
            if id(seq) in picked:
                self.take_picked(seq, picked[id(seq)])

    def refuse(self, refused: list[tuple[Job, Exception]]) -> None:
        """Jobs admission refused (their placement raised): each client hears why."""
        for job, exc in refused:
            self.fail_job(job, exc)

    def prepare_masks(self, seqs: list[Sequence]) -> list[Sequence]:
        """Compute the grammar masks of the rows about to be sampled (on the CPU: the engine calls
        this after launching the step, so on a GPU it overlaps the forward); the rows whose grammar
        fails here fail alone. The rows left to sample."""
        ready = []
        for seq in seqs:
            constraint = seq.sampler.constraint
            if constraint is not None:
                started = time.perf_counter()
                try:
                    constraint.prepare()
                except Exception as exc:  # the schema ran past a limit: this row only
                    self.fail(seq, exc)
                    continue
                finally:
                    self.constraint_s += time.perf_counter() - started
            ready.append(seq)
        return ready

    def take_picked(self, seq: Sequence, pick: Pick) -> None:
        """`pick` is the device's choice for `seq`'s row (sampling.device_picks)."""
        try:
            if not pick.finite:
                raise NonFiniteLogits("the model produced non-finite logits")
            self._take(seq, pick.token, pick.logprob)
        except Exception as exc:  # this row only
            self.fail(seq, exc)

    def chunk_done(self, seq: Sequence, end: int, forward: DeviceSpan) -> None:
        """`seq`'s prompt is computed up to `end` by the step's `forward` (a prompt's last chunk is
        sampled: `prompt_done`; a recompute's last one is not: its next token is taken already)."""
        try:
            if seq.phase is Phase.PROMPT:
                seq.forward_spans.append(forward)
            seq.computed = end
            if seq.phase is Phase.RECOMPUTE and end == len(seq.recompute_ids):  # its KV is back: decode on
                seq.phase, seq.recompute_ids = Phase.DECODE, []
            if seq.phase is Phase.GROUP and end == seq.group_len:
                forward.wait()  # on CUDA: the group is computed, not launched (once a miss, for the log's time)
                self._group_done(seq)
        except Exception as exc:
            self.fail(seq, exc)

    def prompt_done(self, seq: Sequence, pick: Pick) -> None:
        """`seq`'s whole prompt is computed; `pick` is the first token chosen from its logits."""
        try:
            self._prompt_done(seq, pick)
        except Exception as exc:
            self.fail(seq, exc)

    # ---- a sequence's stages -----------------------------------------------------------------

    def _group_done(self, seq: Sequence) -> None:
        seq.phase = Phase.PROMPT
        seq.computed = seq.rest_from  # an earlier turn's KV may already be in the own run
        seq.compile_s = time.perf_counter() - seq.compile_started
        if seq.result != "miss" or seq.key is None:
            return  # a bypass keeps its group to itself
        seq.entry = self.cache.store_group(seq)
        log.info("compiled tool group %s: %d tokens in %.2fs (%.1f MB of KV)", seq.job.group_id or "-",
                 seq.group_len, seq.compile_s, seq.entry.num_bytes / 1e6)
        if seq.computed == len(seq.prompt):  # all group, no token asked (a warm-up): done
            self.retire(seq)
            seq.job.emit(Finished("length", 0))

    def _prompt_done(self, seq: Sequence, pick: Pick) -> None:
        if not pick.finite:
            if seq.result == "hit" and seq.entry is not None:
                self.cache.quarantine(seq.entry, "its KV gave non-finite logits")
                self._recompute(seq)
                return
            raise _NonFinite("the model gave non-finite logits on a plain prefill")
        now = time.perf_counter()  # after the pick was read: on CUDA the prompt is computed, not launched
        seq.forward_s = sum(span.seconds() for span in seq.forward_spans)  # the device's time (done by now)
        job = seq.job
        job.emit(Prefilled(len(seq.prompt), seq.reused, seq.result, seq.tier, 0.0, seq.compile_s,
                           now - seq.admitted_at, seq.forward_s,
                           seq.admitted_at - job.submitted if job.submitted else 0.0, seq.lookup_s))
        seq.phase = Phase.DECODE
        if job.params.max_tokens <= 0:  # the answer is wholly forced (e.g. a call with no arguments)
            self._finish(seq, "length", 0)
            return
        self._take(seq, pick.token, pick.logprob)

    def _recompute(self, seq: Sequence) -> None:
        """Start `seq` again, computing its group privately (its cached copy was bad)."""
        self.scheduler.restart(seq)

    def _take(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        """`token` is the next token of `seq`, chosen from its logits: taken, then the tokens its
        grammar forces after it (`_take_forced`)."""
        if self._take_one(seq, token, logprob):
            seq.pending = [token]
            self._take_forced(seq)

    def _take_forced(self, seq: Sequence) -> None:
        """Take the tokens `seq`'s grammar forces now (none: it allows a choice), then those it
        forces after them, and so on. With `chunk_forced` they go to the model as one chunk with the
        token before them (`pending`: one forward instead of one each); without, they are queued
        in the grammar, whose mask is then each one alone, and chosen a step each: the same tokens
        either way, each with logprob 0 (the masked distribution's: the only allowed token)."""
        constraint = seq.sampler.constraint
        while constraint is not None:
            forced = self._forced(constraint)
            if not forced:
                return
            self.forced_tokens += len(forced)
            if not self.chunk_forced:
                constraint.queue = forced
                return
            for token in forced:
                top = seq.sampler.params.top_logprobs
                logprob = TokenLogprob(token, 0.0, ((token, 0.0),)[:top]) if seq.sampler.params.logprobs else None
                seq.sampler.skipped(token)
                if not self._take_one(seq, token, logprob):
                    return
                seq.pending.append(token)

    def _forced(self, constraint: Constraint) -> list[int]:
        """The tokens `constraint` forces next, up to an end of sequence (that one is chosen)."""
        started = time.perf_counter()
        forced = constraint.forced()
        self.constraint_s += time.perf_counter() - started
        end = next((i for i, token in enumerate(forced) if token in self.eos_ids), len(forced))
        return forced[:end]

    def _take_one(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> bool:
        """`token` is the next token of `seq`: the grammar follows it, its text is emitted, and the
        sequence finishes (False) or goes on (True)."""
        job = seq.job
        constraint = seq.sampler.constraint
        if constraint is not None:
            started = time.perf_counter()
            constraint.accept(token)
            self.constrained_tokens += 1
            self.constraint_s += time.perf_counter() - started
        seq.generated += 1
        if token in self.eos_ids:
            self._finish(seq, "stop", seq.generated - 1)
            return False
        delta = seq.stream.push(token)
        if logprob is not None:  # (after the end-of-sequence check: that one is no answer's)
            seq.logprobs.hold(logprob, seq.stream.text_chars)
        if delta or seq.stream.stopped:
            seq.emit_text(delta, seq.stream.emitted_chars)
        if seq.stream.stopped:
            self.retire(seq, keep_turn=True)  # blocks are free before the client hears it is done
            job.emit(Finished("stop", seq.generated, tuple(seq.stream.token_ids), seq.stream.stopped_by))
            return False
        if seq.generated >= job.params.max_tokens:
            self._finish(seq, "length", job.params.max_tokens)
            return False
        return True

    def _finish(self, seq: Sequence, reason: Literal["stop", "length"], count: int) -> None:
        self.retire(seq, keep_turn=True)  # blocks are free before the client hears it is done
        seq.emit_text(seq.stream.flush(), None)
        seq.job.emit(Finished(reason, count, tuple(seq.stream.token_ids)))

    # ---- leaving the batch -------------------------------------------------------------------

    def retire(self, seq: Sequence, keep_turn: bool = False) -> None:
        """Take `seq` out of the batch and give its blocks back (scheduler.py `retire`)."""
        self.scheduler.retire(seq, keep_turn)

    def fail(self, seq: Sequence, exc: Exception) -> None:
        self.retire(seq)  # before the event, as for a finish
        self.fail_job(seq.job, exc)

    def fail_job(self, job: Job, exc: Exception) -> None:
        failed = _expected(exc)
        if failed is not None:  # the request's own schema, or the shutdown: no fault here
            log.info("generation stopped: %s", exc)
        else:
            log.error("generation failed", exc_info=exc)
            # The client sees no exception text: it may hold a path or other server detail.
            failed = Failed(f"generation failed ({type(exc).__name__}); the server log has the details")
        job.emit(failed)


def _expected(exc: Exception) -> Failed | None:
    """The event of a failure that is no fault of the server's (told to the client in full)."""
    if isinstance(exc, GrammarLimit):
        return Failed(str(exc), exc.param)
    if isinstance(exc, CutOff):
        return Failed(str(exc), shutting_down=True)
    return None


class _NonFinite(RuntimeError):
    pass
