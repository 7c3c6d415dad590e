"""The scheduler: the one owner of the batch. It holds the jobs taken off the intake that are not
running yet (`waiting`), the sequences paused for another tenant's share (`paused`) and the
sequences running (`running`); nothing else adds to or takes from these lists. Each step it
answers one question, `schedule()`: which jobs it admitted (their blocks placed by the cache
manager), which it refused, and what the step computes (`StepPlanner`, below). A sequence leaves the
batch through `retire` (finished, failed, cancelled) or `restart` (its cached group was bad).
A warm-up (`WarmGroup`, a tool group to cache) waits apart (`warming`) and takes a free slot
before the jobs: the cache manager places it on its own path (`place_group`), and its sequence
computes the group like a request's.

Admission is fair between tenants: a free batch slot goes to the waiting job of the tenant with
the fewest sequences running, counting the jobs admitted before it in the same pass (ties: the
oldest job), so one key's backlog delays another key's request by one slot, not by the whole
backlog.

Fair slots: while another tenant waits, no tenant holds more than its share of the batch,
`max_batch // tenants` (tenants: those with work running, waiting or paused; one slot at least).
A tenant below its share whose work finds the batch full takes the slot of the youngest decoding
sequence of the tenant furthest above its share. That sequence is paused, not dropped: it keeps
its KV blocks, sampler and text, leaves the batch and resumes where it stopped when a slot is free
and it is its tenant's turn (a tenant's paused sequences before its waiting jobs: they are older).
So a key with many long generations delays another key's request by a step, never by a
generation, and no work is lost or done twice. Chosen over a cap on each tenant's running
sequences at admission: a cap cannot know that a second tenant will come, so it either leaves
slots idle while one tenant is alone or still makes a newcomer wait for a generation to end.
Only decoding sequences are paused (a prompt may be compiling a group others wait for); with
fewer slots than tenants (`max_batch` 1) a tenant keeps its slot until its row ends.

Fair blocks: a running sequence holds blocks for all of its `max_tokens` and a paused one keeps
them, so one key's long generations could hold the KV pool and another key's small request
would wait out a whole generation (HOLD). When a job cannot be placed for lack of blocks (the
cache manager's `held_for_blocks`), its tenant holds fewer own blocks than its share of the
pool (`num_blocks // tenants`), and another tenant holds more than its share, the youngest
decoding sequence (running or paused) of the tenant furthest above its share is preempted by
recompute, as vLLM does: its own run goes back to the pool (never the group's blocks, which
the cache and other sequences hold too) and it waits with the paused ones; placed again (the
same size; not while a job of a tenant below its share waits for blocks in the same pass), it
computes its prompt and the tokens it had fed in prompt chunks and decodes on from there,
sampler, grammar and text as they were (sequence.py `preempt`). A sequence is preempted again
only after it took a token, so each moves on. Pauses and preemptions are counted (`num_paused`:
`vllm:num_preemptions_total`); tests/engine/test_fair_slots.py pins the order.

The step (`StepPlanner`: what one step computes out of the running batch; it only chooses from
the batch the scheduler owns). Every decoding sequence advances by one token, all in one batched
forward pass. Prompts are prefilled in chunks (cut by the prompt's tokens alone, see
engine/prefix_index.py), at most `chunk_tokens` prompt tokens a step beside the decodes, shortest
remaining prompt first: a hit's short suffix goes ahead of a long tool-group compile, and every
step still advances the decodes, so nobody waits for a compile to finish.

Between tenants a step is fair (deficit round robin). When two or more tenants have work, each
step gives every tenant the same quantum: the cost of what the tenant with the least work would
run alone, so that one runs as if alone and a step costs about `tenants` times as much; a tenant
with more work takes its items (least recently run first) while its credit lasts and carries the
rest of its credit to the next step, so its larger items (a long chunk) still come. Costs are in
prompt tokens (`cost`). Without batch invariance every token of a step is in one product: a chunk
costs its tokens, and decode rows so little that all go in every step, uncharged; only the
prefill is shared.

Engine thread only; `num_waiting` may be read from any thread (a snapshot).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.engine.cache_manager import HOLD, Hold, KVCacheManager, Placement
from gateway.engine.events import Job, WarmGroup
from gateway.engine.sequence import Phase, Sequence

SequenceMaker = Callable[[Job, Placement], Sequence]  # an admitted job's sequence (Sequence.admitted)


class Scheduler:
    def __init__(self, cache: KVCacheManager, make_sequence: SequenceMaker, *, max_batch: int,
                 chunk_tokens: int, batch_invariant: bool = False) -> None:
        self.cache = cache
        self.make_sequence = make_sequence
        self.max_batch = max_batch
        self.planner = StepPlanner(chunk_tokens, batch_invariant)
        self.waiting: list[Job] = []  # taken off the intake, not admitted yet, oldest first
        self.paused: list[Sequence] = []  # out of the batch for another tenant's share, oldest first
        self.running: list[Sequence] = []
        self.warming: list[WarmGroup] = []  # warm-ups taken off the intake, not placed yet, oldest first
        self.num_paused = 0  # sequences paused since start (the engine's preemptions)
        self.num_cancelled = 0  # sequences stopped because their client went away

    @property
    def chunk_tokens(self) -> int:
        return self.planner.chunk_tokens

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.paused) + len(self.warming)

    @property
    def holding(self) -> bool:
        """Whether work waits for blocks (the engine re-checks the pool while idle)."""
        return bool(self.waiting or self.warming)

    @property
    def idle(self) -> bool:
        """Nothing running or paused (jobs may wait for blocks)."""
        return not self.running and not self.paused

    def add(self, item: Job | WarmGroup) -> None:
        if isinstance(item, WarmGroup):
            self.warming.append(item)
        elif not item.cancelled.is_set():
            self.waiting.append(item)

    # ---- a step ------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Drop what was cancelled (its blocks free at once), admit what fits, fairest first, and
        plan the step over the batch."""
        self._drop_cancelled()
        refused = self.admit()
        plan = self.planner.plan(self.running)
        plan.refused = refused
        return plan

    def admit(self) -> list[tuple[Job, Exception]]:
        """Admit waiting jobs and resume paused sequences, fairest first, while fewer than
        `max_batch` run, or by pausing a sequence of a tenant above its share of the batch, or by
        preempting one above its share of the pool for blocks (module doc). The
        jobs whose placement raised, with why: they are no longer waiting."""
        refused = self._admit_warming()
        short: set[str] = set()  # tenants below their pool share whose job waits for blocks in this pass
        for item in self.admission_order():
            victim = None
            if len(self.running) >= self.max_batch:
                victim = self._victim(_tenant(item))
                if victim is None:
                    continue
            if not isinstance(item, Job):  # a paused sequence
                if not self._resume(item, short):
                    continue
            elif not self._admit_job(item, refused, short):
                continue
            if victim is not None and victim in self.running:  # (not preempted for blocks meanwhile)
                self._pause(victim)
        return refused

    def admission_order(self) -> list[Job | Sequence]:
        """The paused sequences and waiting jobs, fairest first: round robin over tenants, fewest
        running first; a tenant's paused sequences before its waiting jobs."""
        turns = Counter(seq.job.tenant for seq in self.running)
        ranked = []
        for index, item in enumerate(self._queued()):
            ranked.append((turns[_tenant(item)], index, item))
            turns[_tenant(item)] += 1
        return [item for _, _, item in sorted(ranked, key=lambda r: r[:2])]

    def waiting_turn(self) -> bool:
        """Whether something waiting could run now: a free slot for waiting or paused work, or a
        tenant below its share while another is above it (no step is launched ahead then)."""
        tenants = {_tenant(item) for item in self._queued()}
        if tenants and len(self.running) < self.max_batch:
            return True
        return any(self._victim(tenant) is not None for tenant in tenants) or \
            any(self._pool_victim(tenant) is not None for tenant in {job.tenant for job in self.waiting})

    # ---- leaving the batch -------------------------------------------------------------------

    def retire(self, seq: Sequence, keep_turn: bool = False) -> None:
        """Take `seq` out of the batch and give its blocks back; `keep_turn`: keep its prompt's KV
        (after the group) as a conversation record first."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.paused:
            self.paused.remove(seq)
        else:
            return  # retired already (a row that failed after it finished): its blocks went back once
        if keep_turn:
            self.cache.keep_turn(seq)
        self.cache.retire(seq)
        seq.release()

    def restart(self, seq: Sequence) -> None:
        """Start `seq`'s job again, its group computed privately (its cached copy was bad); ahead of
        every other job when it does not fit now."""
        self.retire(seq)
        again = self._place(seq.job, recompute=True)
        if again is HOLD:
            self.waiting.insert(0, seq.job)
        else:
            self.running.append(again)

    def resume_all(self) -> None:
        """Every paused sequence back in the batch (the engine stops, or cuts every generation off)."""
        self.running.extend(self.paused)
        self.paused.clear()

    # ---- inside ------------------------------------------------------------------------------

    def _drop_cancelled(self) -> None:
        self.waiting[:] = [job for job in self.waiting if not job.cancelled.is_set()]
        for seq in [s for s in (*self.running, *self.paused) if s.job.cancelled.is_set()]:
            self.num_cancelled += 1
            self.retire(seq)

    def _place(self, job: Job, recompute: bool = False) -> Sequence | Hold:
        """A sequence for `job` with all its blocks, or HOLD (not now)."""
        placement = self.cache.admit(job, recompute)
        if placement is HOLD:
            return placement
        seq = self.make_sequence(job, placement)
        if seq.phase is Phase.GROUP:
            self.cache.start_compiling(seq)
        return seq

    def _admit_job(self, job: Job, refused: list[tuple[Job, Exception]], short: set[str]) -> bool:
        """Whether `job` took a slot (or was refused: it no longer waits); short of blocks, by
        preempting sequences of a tenant above its share of the pool (module doc)."""
        while True:
            try:
                seq = self._place(job)
            except Exception as exc:
                self.waiting.remove(job)
                refused.append((job, exc))
                return False
            if seq is not HOLD:
                break
            victim = self._pool_victim(job.tenant) if self.cache.held_for_blocks else None
            if victim is None:
                return False
            short.add(job.tenant)
            self._preempt(victim)
        self.waiting.remove(job)
        self.running.append(seq)
        return True

    def _resume(self, seq: Sequence, short: set[str]) -> bool:
        """Whether the paused `seq` is back in the batch: at once with its blocks; preempted by
        recompute, once its own run is placed again, but not while another tenant's job waits for
        the blocks its preemption gave back."""
        if seq.own_run is None and (short - {seq.job.tenant} or not self.cache.place_own(seq)):
            return False
        self.paused.remove(seq)
        self.running.append(seq)
        return True

    def _admit_warming(self) -> list[tuple[Job, Exception]]:
        """Place the warm-ups that fit while there are free slots (the cache manager resolves those
        whose group is cached already); those whose placement raised, with why."""
        refused: list[tuple[Job, Exception]] = []
        for warm in list(self.warming):
            if len(self.running) >= self.max_batch:
                break
            try:
                placement = self.cache.place_group(warm)
            except Exception as exc:
                self.warming.remove(warm)
                refused.append((warm.job, exc))
                continue
            if placement is HOLD:
                continue
            self.warming.remove(warm)
            if placement is not None:
                seq = self.make_sequence(warm.job, placement)
                self.cache.start_compiling(seq)
                self.running.append(seq)
        return refused

    def _queued(self) -> list[Job | Sequence]:
        return [*self.paused, *self.waiting]

    def _share(self) -> int:
        """Each tenant's share of the batch: its slots over the tenants with work."""
        tenants = {seq.job.tenant for seq in self.running} | {_tenant(item) for item in self._queued()}
        return max(1, self.max_batch // max(1, len(tenants)))

    def _victim(self, tenant: str) -> Sequence | None:
        """The sequence to pause so that `tenant` gets a slot of a full batch: the youngest decoding
        one of the tenant furthest above its share that has one; None when `tenant` has its share
        already, or no tenant above its share is decoding."""
        counts = Counter(seq.job.tenant for seq in self.running)
        share = self._share()
        if counts[tenant] >= share:
            return None
        for over in (t for t, count in counts.most_common() if count > share):
            decoding = [seq for seq in self.running if seq.job.tenant == over and seq.phase is Phase.DECODE]
            if decoding:
                return max(decoding, key=lambda seq: seq.job.submitted)
        return None

    def _pool_victim(self, tenant: str) -> Sequence | None:
        """The sequence to preempt by recompute so that `tenant`'s job gets blocks: the youngest
        decoding one (running or paused) of the tenant furthest above its share of the pool that
        has one; None when `tenant` holds its share already, or no tenant above it has one."""
        held: Counter[str] = Counter()
        for seq in (*self.running, *self.paused):
            held[seq.job.tenant] += seq.own_blocks
        if not +held:
            return None
        tenants = {seq.job.tenant for seq in self.running} | {_tenant(item) for item in self._queued()}
        share = self.cache.pool.num_blocks // max(1, len(tenants))
        if held[tenant] >= share:
            return None
        for over, count in held.most_common():
            if count <= share:
                break
            able = [seq for seq in (*self.running, *self.paused) if seq.job.tenant == over and seq.recomputable]
            if able:
                return max(able, key=lambda seq: seq.job.submitted)
        return None

    def _preempt(self, seq: Sequence) -> None:
        """Preempt `seq` by recompute: its own blocks back to the pool, it waits with the paused."""
        seq.preempt(self.chunk_tokens)
        if seq in self.running:
            self._pause(seq)

    def _pause(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.paused.append(seq)
        self.paused.sort(key=lambda s: s.job.submitted)
        self.num_paused += 1


def _tenant(item: Job | Sequence) -> str:
    return item.tenant if isinstance(item, Job) else item.job.tenant



# ---- the step planner: what one step computes ------------------------------------------------
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
