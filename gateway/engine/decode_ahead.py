"""Decode steps launched ahead (`decode_overlap`): a run of decode steps back to back, each
launched before the tokens of the one before it are read. Its token ids are that step's picks
(`device_picks`), copied on the device, so the host's reading, detokenizing, streaming and grammar
work overlap the next forward (on CUDA, where a launch returns at once). A row's inputs are those
the engine's ordinary step gives it; a step launched ahead still holds the rows that end on the
token being read, so its batch can be larger than an ordinary step's, which changes rounding only
where batches do (not with `batch_invariant`; never for a request alone). Penalties count each
pick on the device, so they need no read; logprobs and `logit_bias` are per-row tensors.

A row with a grammar runs ahead on a guess, checked before anything uses it: the mask of the step
launched ahead depends on the token not read yet, so that step is sampled with the mask of the
step being read (vLLM does not run grammar rows ahead at all; a speculative mask checked
afterwards keeps the overlap where grammars spend most tokens: free text under `tool_choice:
auto`, whose mask is the same token after token, and long strings). Once the token is read and
the grammar follows it, the row's real mask is computed; if it equals the guess and nothing is
forced, the pick was made exactly as an ordinary step makes it. If not, the row's pick of the
step in flight is dropped (its penalty count taken back, its random stream rewound:
`Sampler.mark`), the run ends, and the next ordinary step feeds the token again with the tokens
forced after it, rewriting the same KV slot: what the sequence writes is what it writes without
steps launched ahead.

The run starts from a step of every running sequence, one token each (`starts`), and a step is
launched ahead only while nothing else waits that could run (`_may_go_on`), no guess failed, and
no row reaches `max_tokens` with the token being read; so the run ends within one step of any of
these, and the engine's loop takes over. A row that stops on the token being read (end of
sequence, a stop string, non-finite logits) has one step computed past its end: its KV goes to the
next slot of its own run (reserved for `max_tokens`), which nothing reads, and its logits are
dropped. A forward that fails raises to the engine's loop, which fails every running row: all of
them are in the run. tests/engine/test_decode_overlap.py.
"""

from __future__ import annotations

import time

import torch

from gateway.engine.events import Intake
from gateway.engine.model_runner import ModelRunner, staged
from gateway.engine.outputs import OutputProcessor
from gateway.engine.sampling import Picks, device_picks
from gateway.engine.scheduler import Scheduler, StepPlan
from gateway.engine.sequence import Sequence
from gateway.engine.stats import StepCounts


class DecodeAhead:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, outputs: OutputProcessor, intake: Intake,
                 counts: StepCounts) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.outputs = outputs
        self.intake = intake
        self.counts = counts
        self.ahead_steps = 0  # decode steps launched before the one before them was read

    def starts(self, plan: StepPlan) -> bool:
        """Whether `plan` may start a run: a step of every running sequence's decode row, one token
        each (not a chunk of forced tokens)."""
        return not plan.prefill and len(plan.decode) == len(self.scheduler.running) and all(
            len(seq.pending) == 1 for seq in plan.decode)

    def run(self, seqs: list[Sequence]) -> None:
        """Steps of `seqs`' decode rows, each launched before the one before it is read, while the
        run may go on (module doc)."""
        seqs = self.outputs.prepare_masks(seqs)
        if not seqs:
            return
        flight: tuple[list[Sequence], Picks] | None = (seqs, self._launch(seqs, None))
        wrong: set[int] = set()  # rows whose pick in flight was made on a wrong guess
        last_read = time.perf_counter()
        while flight is not None:
            seqs, picks = flight
            running = {id(seq) for seq in self.scheduler.running}
            alive = [i for i, seq in enumerate(seqs) if id(seq) in running]
            ahead = None
            if not wrong and self._may_go_on([seqs[i] for i in alive]):
                ahead_seqs = [seqs[i] for i in alive]
                ahead = (ahead_seqs, self._launch(ahead_seqs, picks.best, alive))
                self.ahead_steps += 1
            read = picks.read()
            for i in alive:
                if id(seqs[i]) in wrong:
                    seqs[i].sampler.dropped(read[i].token)
                else:
                    self.outputs.take_picked(seqs[i], read[i])  # a row that fails fails alone
            wrong = self._wrong_guesses(ahead[0]) if ahead is not None else set()
            now = time.perf_counter()
            self.counts.add(len(alive), len(alive), now - last_read)
            last_read = now
            flight = ahead

    def _wrong_guesses(self, seqs: list[Sequence]) -> set[int]:
        """The rows of the step in flight whose grammar mask was guessed wrong: computed now that
        the token before it is read."""
        running = {id(seq) for seq in self.scheduler.running}
        guessed = [seq for seq in seqs if seq.sampler.guess is not None and id(seq) in running]
        wrong = {id(seq) for seq in guessed if len(seq.pending) != 1}
        for seq in self.outputs.prepare_masks([seq for seq in guessed if id(seq) not in wrong]):
            constraint, guess = seq.sampler.constraint, seq.sampler.guess
            assert constraint is not None and constraint.bitmask is not None and guess is not None
            if not torch.equal(constraint.bitmask, guess):
                wrong.add(id(seq))
        return wrong

    def _may_go_on(self, seqs: list[Sequence]) -> bool:
        """Whether the next step may be launched before this one is read: nothing waits that could
        run (a job of a tenant at its share of a full batch cannot: a row must end first;
        scheduler.py `waiting_turn`), no client is gone, and no row ends by `max_tokens` with the
        token being read."""
        if self.intake.busy or self.scheduler.waiting_turn():
            return False
        return bool(seqs) and all(
            not seq.job.cancelled.is_set() and seq.generated + 1 < seq.job.params.max_tokens for seq in seqs)

    def _launch(self, seqs: list[Sequence], after: torch.Tensor | None, rows: list[int] | None = None) -> Picks:
        """One decode step of `seqs`: their next tokens from the host, or the picks `after` of the
        step before (at its `rows`), one token past what the host has read; a grammar row launched
        ahead guesses its mask (module doc)."""
        tokens = [list(seq.pending) for seq in seqs]  # `ids`, when given, replace them
        ids = after
        if after is not None and rows is not None and len(rows) < after.shape[0]:
            # rows that ended on the step being read are left out (staged: no wait for the step in flight)
            ids = after.index_select(0, staged(rows, torch.long, after.device))
        rows_kv = [seq.row(1, ahead=int(after is not None)) for seq in seqs]
        logits = self.runner.forward(tokens, rows_kv, ids)
        for seq in seqs:
            seq.sampler.mark(logits.device, guessed=after is not None)
        return device_picks(logits, [seq.sampler for seq in seqs])
