"""The step planner: what one step of the loop computes, out of the running batch (the
scheduler owns the batch, scheduler.py; the planner only chooses from it).

Every decoding sequence advances by one token, all in one batched forward pass. Prompts are
prefilled in chunks (cut by the prompt's tokens alone, see engine/prefix_index.py), at
most `chunk_tokens` prompt tokens a step beside the decodes, shortest remaining prompt first: a
hit's short suffix goes ahead of a long tool-group compile, and every step still advances the
decodes, so nobody waits for a compile to finish.

Between tenants it is fair (deficit round robin). When two or more tenants have work, each step
gives every tenant the same quantum: the cost of what the tenant with the least work would run
alone, so that one runs as if alone and a step costs about `tenants` times as much; a tenant with
more work takes its items (least recently run first) while its credit lasts and carries the rest
of its credit to the next step, so its larger items (a long chunk) still come. Costs are in prompt
tokens (`cost`). Without batch invariance every token of a step is in one product: a chunk costs
its tokens, and decode rows so little that all go in every step, uncharged; only the prefill is
shared.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from gateway.engine.events import Job
from gateway.engine.sequence import Phase, Sequence

# With batch-invariant linears (model_runner.py) a prompt chunk is a matrix product and a fused
# attention of its own, while the decode rows share one batched matrix-vector product. Measured on
# the CPU with the default model: a decode row added ~24 ms to a step, a chunk ~100 ms and under
# 0.5 ms a token; so, in tokens, a row costs 48 and a chunk 200 more than its tokens.
INVARIANT_ROW_COST = 48
INVARIANT_CHUNK_COST = 200


@dataclass(slots=True)
class StepPlan:
    """What one step computes: a decode row of each of `decode`, a prompt chunk of each of
    `prefill`; and the jobs admission refused this step (`refused`: their clients hear why)."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int, int]] = field(default_factory=list)  # sequence, [start, end)
    refused: list[tuple[Job, Exception]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(end - start for _, start, end in self.prefill)


class StepPlanner:
    def __init__(self, chunk_tokens: int, batch_invariant: bool = False) -> None:
        self.chunk_tokens = chunk_tokens
        self.rows_shared = batch_invariant  # decode rows are shared out between tenants too
        self.row_cost = INVARIANT_ROW_COST if batch_invariant else 0
        self.chunk_cost = INVARIANT_CHUNK_COST if batch_invariant else 0
        self._credit: dict[str, int] = {}  # tenant -> cost it may still spend (fair steps only)
        self._steps = 0

    def plan(self, running: list[Sequence]) -> StepPlan:
        self._steps += 1
        tenants: dict[str, list[Sequence]] = defaultdict(list)
        for seq in running:
            if self.rows_shared or seq.phase is not Phase.DECODE:  # what the fair share counts
                tenants[seq.job.tenant].append(seq)
        if len(tenants) < 2:
            self._credit.clear()
            plan = self._alone(running)
        else:
            plan = self._shared(tenants)
            if not self.rows_shared:
                plan.decode = [s for s in running if s.phase is Phase.DECODE]
        for seq in (*plan.decode, *(seq for seq, _, _ in plan.prefill)):
            seq.last_step = self._steps
        return plan

    def _alone(self, running: list[Sequence]) -> StepPlan:
        """Every decode row, and prompt chunks shortest remaining first within the token budget."""
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

    def _shared(self, tenants: dict[str, list[Sequence]]) -> StepPlan:
        """Each tenant's quantum of work; the tenant owed the most goes first."""
        for gone in self._credit.keys() - tenants.keys():
            del self._credit[gone]
        quantum = min(self._cost(self._alone(seqs)) for seqs in tenants.values())
        for tenant in tenants:
            self._credit[tenant] = self._credit.get(tenant, 0) + quantum
        plan = StepPlan()
        owed = sorted(tenants, key=lambda t: -self._credit[t])
        for tenant in owed:
            if self._take(plan, tenants[tenant], tenant):
                self._credit[tenant] = 0  # nothing left waiting: no credit is banked
        if not plan:  # no tenant's next item fits its credit yet: the one owed most runs it on credit
            self._take(plan, tenants[owed[0]], owed[0], debt=True)
        return plan

    def _take(self, plan: StepPlan, seqs: list[Sequence], tenant: str, debt: bool = False) -> bool:
        """Add `seqs`' items in turn while the tenant's credit and the step's token budget last
        (`debt`: the first one whatever it costs); True when all of them went."""
        budget = self.chunk_tokens - sum(end - start for _, start, end in plan.prefill)
        for seq in sorted(seqs, key=_turn):
            if seq.phase is Phase.DECODE:
                cost = self.row_cost
            else:
                start, end = seq.next_chunk()
                if plan.prefill and end - start > budget:
                    return False
                cost = self.chunk_cost + end - start
            if cost > self._credit[tenant] and not (debt and not plan):
                return False
            self._credit[tenant] -= cost
            if seq.phase is Phase.DECODE:
                plan.decode.append(seq)
            else:
                plan.prefill.append((seq, start, end))
                budget -= end - start
        return True

    def _cost(self, plan: StepPlan) -> int:
        """What `plan` costs, in prompt tokens: a chunk its tokens and `chunk_cost`, a row `row_cost`."""
        chunks = sum(self.chunk_cost + end - start for _, start, end in plan.prefill)
        return chunks + len(plan.decode) * self.row_cost


def _turn(seq: Sequence) -> tuple[int, bool, int]:
    """A tenant's items, least recently run first; then decode rows, then the shortest prompt."""
    return seq.last_step, seq.phase is not Phase.DECODE, seq.remaining_prefill
