"""What a step's output does to each sequence it computed (engine thread only): a group's last
chunk stores the group, a prompt's last chunk sends `Prefilled` and samples the first token, a
decode row samples the next one (greedy or temperature + top-p with nothing else to apply: on the
device, all such rows at once, `device_picks`); each token's text is emitted, and a sequence that
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
from collections.abc import Callable
from typing import Literal

import torch

from gateway.engine.cache_manager import KVCacheManager
from gateway.engine.constraints import GrammarLimit
from gateway.engine.events import CutOff, Failed, Finished, Job, Prefilled
from gateway.engine.sampling import NonFiniteLogits, all_finite, on_host, picks_of
from gateway.engine.sequence import Phase, Sequence

log = logging.getLogger("gateway.engine.core")  # the engine's logger, as before this module was split off

FIRST_TOKEN_HANDOFF_S = 0.05


class OutputProcessor:
    def __init__(self, running: list[Sequence], cache: KVCacheManager, eos_ids: frozenset[int],
                 restart: Callable[[Job], None]) -> None:
        self._running = running  # the engine's running batch, shared: retiring a sequence takes it out
        self.cache = cache
        self.eos_ids = eos_ids
        self._restart = restart  # admit a job again, its group computed privately (Engine._readmit)
        self.constrained_tokens = 0
        self.constraint_s = 0.0

    # ---- a step's rows -----------------------------------------------------------------------

    def decode(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample each decode row: the plain greedy and plain sampled ones on the device, all at
        once; the others per sequence, from one copy of their rows."""
        samplers = [seq.sampler for seq in seqs]
        picked = picks_of(logits, samplers, [i for i, s in enumerate(samplers) if s.plain or s.on_device])
        others = [i for i in range(len(seqs)) if i not in picked]
        host = dict(zip(others, on_host(logits[others]) if others else (), strict=True))
        for index, seq in enumerate(seqs):
            if index in picked:
                self.take_picked(seq, *picked[index])
                continue
            try:
                self._advance(seq, host[index])
            except Exception as exc:  # a grammar that refused a token: this one only
                self.fail(seq, exc)

    def take_picked(self, seq: Sequence, token: int, finite: int) -> None:
        """`token` is the device's pick for `seq`'s row (argmax or sample); `finite`: whether that
        row's logits were (1/0)."""
        try:
            if not finite:
                raise NonFiniteLogits("the model produced non-finite logits")
            self._take(seq, token)
        except Exception as exc:  # this row only
            self.fail(seq, exc)

    def chunk_done(self, seq: Sequence, end: int, logits: torch.Tensor, started: float) -> None:
        """`seq`'s prompt is computed up to `end`; `logits` are its last token's."""
        try:
            if seq.phase is Phase.PROMPT:
                seq.forward_s += time.perf_counter() - started
            seq.computed = end
            if seq.phase is Phase.GROUP and end == seq.group_len:
                self._group_done(seq)
            elif seq.phase is Phase.PROMPT and end == len(seq.prompt):
                on_device = seq.sampler.plain or seq.sampler.on_device
                self._prompt_done(seq, logits if on_device else on_host(logits))
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
        if seq.job.warm is not None:
            self.retire(seq)
            seq.job.warm.set_result((seq.entry, False))

    def _prompt_done(self, seq: Sequence, logits: torch.Tensor) -> None:
        if not all_finite(logits):
            if seq.result == "hit" and seq.entry is not None:
                self.cache.quarantine(seq.entry, "its KV gave non-finite logits")
                self._recompute(seq)
                return
            raise _NonFinite("the model gave non-finite logits on a plain prefill")
        now = time.perf_counter()
        job = seq.job
        job.emit(Prefilled(len(seq.prompt), seq.reused, seq.result, seq.tier, 0.0, seq.compile_s,
                           now - seq.admitted_at, seq.forward_s,
                           seq.admitted_at - job.submitted if job.submitted else 0.0, seq.lookup_s))
        seq.phase = Phase.DECODE
        if job.params.max_tokens <= 0:  # the answer is wholly forced (e.g. a call with no arguments)
            self._finish(seq, "length", 0)
            return
        self._advance(seq, logits)

    def _recompute(self, seq: Sequence) -> None:
        """Start `seq` again, computing its group privately (its cached copy was bad)."""
        self.retire(seq)
        self._restart(seq.job)

    def _advance(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample the next token of `seq`, emit its text, and finish it or queue the token."""
        token = seq.sampler.next_token(logits)
        if seq.sampler.constraint is not None:
            self.constrained_tokens += 1
            self.constraint_s += seq.sampler.constraint_s
        self._take(seq, token)

    def _take(self, seq: Sequence, token: int) -> None:
        """`token` is the next token of `seq`: emit its text, and finish or queue it."""
        job = seq.job
        seq.generated += 1
        if token in self.eos_ids:
            self._finish(seq, "stop", seq.generated - 1)
            return
        delta = seq.stream.push(token)
        if seq.sampler.last_logprob is not None:  # (after the end-of-sequence check: that one is no answer's)
            seq.logprobs.hold(seq.sampler.last_logprob, seq.stream.text_chars)
        if delta or seq.stream.stopped:
            seq.emit_text(delta, seq.stream.emitted_chars)
        if delta and job.first_token_sent is not None and not seq.first_token_handed_off:
            seq.first_token_handed_off = True
            job.first_token_sent.wait(FIRST_TOKEN_HANDOFF_S)
        if seq.stream.stopped:
            self.retire(seq, keep_turn=True)  # blocks are free before the client hears it is done
            job.emit(Finished("stop", seq.generated, tuple(seq.stream.token_ids), seq.stream.stopped_by))
            return
        if seq.generated >= job.params.max_tokens:
            self._finish(seq, "length", job.params.max_tokens)
            return
        seq.next_token = token

    def _finish(self, seq: Sequence, reason: Literal["stop", "length"], count: int) -> None:
        self.retire(seq, keep_turn=True)  # blocks are free before the client hears it is done
        seq.emit_text(seq.stream.flush(), None)
        seq.job.emit(Finished(reason, count, tuple(seq.stream.token_ids)))

    # ---- leaving the batch -------------------------------------------------------------------

    def retire(self, seq: Sequence, keep_turn: bool = False) -> None:
        """Take `seq` out of the batch and give its blocks back; `keep_turn`: keep its prompt's KV
        (after the group) as a conversation record first."""
        if seq not in self._running:
            return  # retired already (a row that failed after it finished): its blocks went back once
        if keep_turn:
            self.cache.keep_turn(seq)
        self._running.remove(seq)
        self.cache.retire(seq)
        seq.release()

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
        if job.warm is not None:
            job.warm.set_exception(exc)
        else:
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
