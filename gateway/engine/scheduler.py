"""The scheduler: what one step of the loop computes.

Every decoding sequence advances by one token, all in one batched forward pass. Prompts are
prefilled in chunks (cut by the prompt's tokens alone, see engine/chunks.py), at
most `chunk_tokens` prompt tokens a step beside the decodes, shortest remaining prompt first: a
hit's short suffix goes ahead of a long tool-group compile, and every step still advances the
decodes, so nobody waits for a compile to finish.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.engine.sequence import Phase, Sequence


@dataclass(slots=True)
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int, int]] = field(default_factory=list)  # sequence, [start, end)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(end - start for _, start, end in self.prefill)


class Scheduler:
    def __init__(self, chunk_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens

    def plan(self, running: list[Sequence]) -> StepPlan:
        plan = StepPlan(decode=[s for s in running if s.phase is Phase.DECODE])
        budget = self.chunk_tokens
        for seq in sorted((s for s in running if s.phase is not Phase.DECODE), key=lambda s: s.remaining_prefill):
            start, end = seq.next_chunk()
            if plan.prefill and end - start > budget:
                break
            plan.prefill.append((seq, start, end))
            budget -= end - start
            if budget <= 0:
                break
        return plan
