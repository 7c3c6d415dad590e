"""Fair slots (gateway/engine/scheduler.py): while another tenant waits, no key holds more than its
share of the batch. Key A's long generations fill every slot; key B's request takes the slot of
A's youngest decoding sequence, which is paused (its KV and text kept) and resumes where it
stopped. Model-free tests pin the admission order, in the manner of vLLM's tests/v1/core; one
engine test on a tiny model shows what a user notices: B's 1-token answer comes while A's
generations are still running, and A's tokens are what they are alone. Fair blocks: A's long
generations hold the KV pool; B's job, short of blocks, takes the own blocks of A's youngest,
preempted by recompute (model-free: which blocks go and come back; on the tiny model: B answered
while A's decode, A's tokens, text and grammar as alone)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from gateway.engine import Finished, Job, Prefilled, TextDelta
from gateway.engine.cache_manager import HOLD, Hold, KVCacheManager, Placement
from gateway.engine.events import EngineEvent
from gateway.engine.sampling import Sampler, SamplingParams
from gateway.engine.scheduler import Scheduler
from gateway.engine.sequence import Phase, Sequence, TextStream
from gateway.protocol.chat import ChatCompletionRequest
from gateway.serving.runtime import Runtime
from tests.engine.test_batching import TINY_KV_BYTES_PER_TOKEN
from tests.engine.test_cache_manager import GROUP, compile_and_finish, manager
from tests.engine.test_tenant_fairness import Trace


@dataclass
class Slot:
    """What admission reads of a running sequence (its job and its phase), and the step planner
    (its next chunk)."""

    job: Job
    phase: Phase = Phase.PROMPT
    remaining_prefill: int = 3
    last_step: int = 0
    own_run: object = "its blocks"  # never given back: nothing here is short of blocks
    own_blocks: int = 0

    def next_chunk(self) -> tuple[int, int]:
        return 0, 3

    def release(self) -> None:
        """No blocks: nothing to give back."""


def job(tenant: str, name: str, at: float) -> Job:
    made = Job([1, 2, 3], 0, SamplingParams(max_tokens=100), emit=lambda _: None, tenant=tenant, group_id=name)
    made.submitted = at
    return made


def names(seqs: list[Sequence]) -> list[str]:
    return [seq.job.group_id for seq in seqs]


def held(batch: Batch) -> list[str]:
    return [job.group_id for job in batch.scheduler.waiting]


class Placer:
    """The cache manager's side of admission, without blocks: a job is placed when it `fits`."""

    def __init__(self, fits: Callable[[Job], bool]) -> None:
        self.fits = fits
        self.held_for_blocks = False  # a job that does not fit waits; nobody is preempted for it

    def admit(self, job: Job, recompute: bool = False) -> Placement | Hold | None:
        return cast(Placement, object()) if self.fits(job) else HOLD

    def retire(self, seq: Sequence) -> None:
        """No cache entry to let go."""


class Batch:
    """A scheduler whose admitted jobs are sequences without blocks, which decode once `decode` is
    called (a sequence still prefilling is never paused)."""

    def __init__(self, max_batch: int, fits: Callable[[Job], bool] = lambda _: True) -> None:
        placer = cast(KVCacheManager, Placer(fits))
        self.scheduler = Scheduler(placer, lambda job, _: cast(Sequence, Slot(job)), max_batch=max_batch,
                                   chunk_tokens=128)
        self.running = self.scheduler.running
        self.clock = 0.0

    def hold(self, tenant: str, *labels: str) -> None:
        for label in labels:
            self.clock += 1
            self.scheduler.add(job(tenant, label, self.clock))

    def admit(self) -> None:
        self.scheduler.admit()

    def drop_cancelled(self) -> None:
        self.scheduler.schedule()

    def decode(self) -> None:
        for seq in self.running:
            seq.phase = Phase.DECODE

    def finish(self, label: str) -> None:
        self.scheduler.retire(next(seq for seq in self.running if seq.job.group_id == label))


def test_a_tenant_alone_uses_every_slot() -> None:
    batch = Batch(max_batch=4)
    batch.hold("a", "a0", "a1", "a2", "a3", "a4")
    batch.admit()
    assert names(batch.running) == ["a0", "a1", "a2", "a3"] and batch.scheduler.num_paused == 0


def test_a_newcomer_takes_the_slot_of_the_full_tenants_youngest_decoding_sequence() -> None:
    batch = Batch(max_batch=4)
    batch.hold("a", "a0", "a1", "a2", "a3", "a4")
    batch.admit()
    batch.decode()
    batch.hold("b", "b0")
    batch.admit()
    assert names(batch.running) == ["a0", "a1", "a2", "b0"]
    assert names(batch.scheduler.paused) == ["a3"] and batch.scheduler.num_paused == 1
    assert held(batch) == ["a4"]  # A's backlog waits behind A's paused one


def test_the_newcomer_gets_its_share_and_no_more() -> None:
    batch = Batch(max_batch=4)
    batch.hold("a", "a0", "a1", "a2", "a3")
    batch.admit()
    batch.decode()
    batch.hold("b", "b0", "b1", "b2", "b3")
    batch.admit()
    assert names(batch.running) == ["a0", "a1", "b0", "b1"]  # 4 slots, 2 tenants: 2 each
    assert names(batch.scheduler.paused) == ["a2", "a3"]  # oldest first: resumed in that order
    batch.decode()
    batch.admit()
    assert names(batch.running) == ["a0", "a1", "b0", "b1"]  # at their shares: nobody moves


def test_a_freed_slot_goes_to_the_paused_sequence_before_its_tenants_new_jobs() -> None:
    batch = Batch(max_batch=4)
    batch.hold("a", "a0", "a1", "a2", "a3", "a4")
    batch.admit()
    batch.decode()
    batch.hold("b", "b0")
    batch.admit()
    batch.finish("b0")
    batch.admit()
    assert names(batch.running) == ["a0", "a1", "a2", "a3"] and not batch.scheduler.paused
    batch.finish("a0")
    batch.admit()
    assert names(batch.running) == ["a1", "a2", "a3", "a4"]


def test_a_prefilling_sequence_is_never_paused() -> None:
    batch = Batch(max_batch=2)
    batch.hold("a", "a0", "a1")
    batch.admit()  # both still prefilling
    batch.hold("b", "b0")
    batch.admit()
    assert names(batch.running) == ["a0", "a1"] and held(batch) == ["b0"]
    assert batch.scheduler.waiting_turn() is False  # nothing can run: steps may go ahead
    batch.decode()
    assert batch.scheduler.waiting_turn() is True
    batch.admit()
    assert names(batch.running) == ["a0", "b0"] and names(batch.scheduler.paused) == ["a1"]


def test_three_tenants_share_the_batch_and_the_largest_gives_way_first() -> None:
    batch = Batch(max_batch=6)
    batch.hold("a", "a0", "a1", "a2", "a3")
    batch.hold("b", "b0", "b1")
    batch.admit()
    batch.decode()
    assert names(batch.running) == ["a0", "b0", "a1", "b1", "a2", "a3"]
    batch.hold("c", "c0", "c1", "c2")
    batch.admit()
    assert sorted(names(batch.running)) == ["a0", "a1", "b0", "b1", "c0", "c1"]  # 2 each
    assert names(batch.scheduler.paused) == ["a2", "a3"] and held(batch) == ["c2"]


def test_a_newcomer_that_does_not_fit_the_pool_pauses_nobody() -> None:
    batch = Batch(max_batch=2, fits=lambda job: job.tenant == "a")
    batch.hold("a", "a0", "a1")
    batch.admit()
    batch.decode()
    batch.hold("b", "b0")
    batch.admit()
    assert names(batch.running) == ["a0", "a1"] and not batch.scheduler.paused and batch.scheduler.num_paused == 0


def test_a_paused_sequence_whose_client_left_is_dropped_and_its_slot_given() -> None:
    batch = Batch(max_batch=2)
    batch.hold("a", "a0", "a1")
    batch.admit()
    batch.decode()
    batch.hold("b", "b0")
    batch.admit()
    paused = batch.scheduler.paused[0]
    paused.job.cancelled.set()
    batch.hold("c", "c0")
    batch.drop_cancelled()
    assert not batch.scheduler.paused and batch.scheduler.num_cancelled == 1  # its blocks freed
    assert names(batch.running) == ["a0", "b0"] and held(batch) == ["c0"]  # 3 tenants, 2 slots: no share to take


def test_b_is_answered_while_a_fills_every_slot_with_long_generations(runtime_for: Callable[..., Runtime]) -> None:
    """Key A has max_batch long generations decoding (and more queued); key B's 1-token request is
    admitted at once and answered before any of A's ends; A's answers are what each gives alone."""
    runtime = runtime_for("llama", max_batch=4)
    trace = Trace()
    a_jobs = [trace.job(runtime, f"a{i}", "tenant-a", max_tokens=60, seed=i) for i in range(6)]
    for a_job in a_jobs:
        runtime.engine.submit(a_job)
    trace.wait_until(lambda: trace.count("a", TextDelta) >= 8)  # four of A's are decoding
    runtime.engine.submit(trace.job(runtime, "b", "tenant-b", max_tokens=1, seed=9))
    trace.wait("b")
    b_done = trace.index("b", Finished)
    assert not [who for who, e in trace.events[:b_done] if isinstance(e, Finished) and who != "b"]
    assert runtime.engine.stats().preemptions_total >= 1
    trace.wait(*(f"a{i}" for i in range(6)))
    assert trace.index("b", Prefilled) < min(trace.index(f"a{i}", Prefilled) for i in (4, 5))  # ahead of A's backlog
    for i, a_job in enumerate(a_jobs):  # paused and resumed, each answer is the one it gives alone
        alone = Trace()
        runtime.engine.submit(alone.job(runtime, "x", "tenant-a", max_tokens=60, seed=i))
        alone.wait("x")
        assert alone.tokens("x") == trace.tokens(f"a{i}") and len(trace.tokens(f"a{i}")) == a_job.params.max_tokens


# ---- fair blocks: one key cannot hold the KV pool ----------------------------------------------

class Letters:
    """A decoder for sequences without a tokenizer: token t writes one letter."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + t % 26) for t in token_ids)


def pooled(num_blocks: int) -> tuple[Scheduler, KVCacheManager]:
    """A scheduler over a real block pool of `num_blocks` blocks of 4 tokens whose tool group (8
    tokens of 1) is cached; its sequences are real, without a model."""
    cache = manager(num_blocks)
    compile_and_finish(cache, Job([1] * GROUP + [100, 101], GROUP, SamplingParams(max_tokens=2)))

    def make(made: Job, placed: Placement) -> Sequence:
        return Sequence(made, placed.group_len, placed.result, placed.own_run, placed.ends,
                        Sampler(made.params), TextStream(Letters(), ()), key=placed.key, entry=placed.entry,
                        computed=placed.rest_from)

    return Scheduler(cache, make, max_batch=8, chunk_tokens=4), cache


def pool_job(tenant: str, name: str, at: float, group: bool, max_tokens: int = 10) -> Job:
    made = Job([1] * GROUP + [100, 101] if group else [100, 101], GROUP if group else 0,
               SamplingParams(max_tokens=max_tokens), tenant=tenant, group_id=name)
    made.submitted = at
    return made


def decoded(seq: Sequence, *tokens: int) -> None:
    """`seq`'s prompt is computed and it took `tokens`, the last one not fed to the model yet."""
    seq.phase, seq.computed = Phase.DECODE, len(seq.prompt)
    for token in tokens:
        seq.stream.push(token)
        seq.generated += 1
    seq.pending = [tokens[-1]]


def test_a_newcomer_short_of_blocks_takes_them_from_the_tenant_above_its_pool_share() -> None:
    """Pool of 10 blocks: the cached group in blocks 1-2, A's two hits 3 own blocks each. B's job
    (3 blocks) does not fit; A holds 6 own blocks, over its share of 5: A's youngest is preempted
    by recompute, its own blocks (and only those: not the group's) go to B. Placed again once B
    ends, it recomputes its prompt after the group and the tokens it had fed, and decodes on."""
    scheduler, cache = pooled(num_blocks=10)
    scheduler.add(pool_job("a", "a0", 1, group=True))
    scheduler.add(pool_job("a", "a1", 2, group=True))
    scheduler.admit()
    a0, a1 = scheduler.running
    assert [list(s.own_run.block_ids) for s in (a0, a1) if s.own_run] == [[3, 4, 5], [6, 7, 8]]
    decoded(a0, 5)
    decoded(a1, 5, 6, 7)
    group_refs = cache.pool.refs(1)
    scheduler.add(pool_job("b", "b0", 3, group=False))
    scheduler.admit()
    assert names(scheduler.running) == ["a0", "b0"] and names(scheduler.paused) == ["a1"]
    b0 = scheduler.running[1]
    assert b0.own_run is not None and list(b0.own_run.block_ids) == [6, 7, 8]  # a1's, given back
    assert a1.own_run is None and cache.pool.refs(1) == group_refs  # the group's blocks stay held
    assert scheduler.num_paused == 1 and a1.phase is Phase.RECOMPUTE and a1.pending == [7]
    assert a1.recompute_ids == [*a1.prompt, 5, 6] and a1.stream.token_ids == [5, 6, 7]  # taken once
    scheduler.admit()
    assert names(scheduler.paused) == ["a1"]  # 2 blocks free: it waits
    scheduler.retire(b0)
    scheduler.admit()
    assert names(scheduler.running) == ["a0", "a1"] and a1.own_run is not None
    assert list(a1.own_run.block_ids) == [6, 7, 8]
    assert [a1.next_chunk(), a1.remaining_prefill] == [(GROUP, GROUP + 2), 4]  # the prompt as cut before
    a1.computed = GROUP + 2
    assert a1.next_chunk() == (GROUP + 2, GROUP + 4)  # then the tokens it had fed
    a1.computed, a1.phase = GROUP + 4, Phase.DECODE
    assert a1.row(1).position == GROUP + 4 and a1.row(1).own_len == 4  # its pending token goes next


def test_a_tenant_within_its_pool_share_is_not_preempted_and_a_preempted_one_moves_on() -> None:
    """A holds one sequence of 3 own blocks (under its share of 4 of 8 blocks): B's job that does
    not fit waits. A sequence preempted and placed again is not preempted again before it took a
    token."""
    scheduler, cache = pooled(num_blocks=8)
    scheduler.add(pool_job("a", "a0", 1, group=True, max_tokens=10))
    scheduler.admit()
    decoded(scheduler.running[0], 5)
    scheduler.add(pool_job("b", "b0", 2, group=False, max_tokens=18))  # 5 blocks: 3 are free
    scheduler.admit()
    assert names(scheduler.running) == ["a0"] and held_jobs(scheduler) == ["b0"] and scheduler.num_paused == 0
    a0 = scheduler.running[0]
    a0.preempt(4)  # as if for someone else
    assert not a0.recomputable and a0.own_run is None
    assert cache.place_own(a0) and a0.own_run is not None
    a0.phase = Phase.DECODE
    assert not a0.recomputable  # no token taken since
    decoded(a0, 6)
    assert a0.recomputable


def held_jobs(scheduler: Scheduler) -> list[str]:
    return [job.group_id for job in scheduler.waiting]


NOTE = {"type": "function", "function": {"name": "note", "description": "A note.", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "minLength": 400}}, "required": ["text"]}}}


class Texts(Trace):
    """A trace that also submits prepared requests' jobs and reads their texts."""

    def emitter(self, label: str) -> Callable[[EngineEvent], None]:
        return self._emitter(label)

    def text(self, label: str) -> str:
        return "".join(e.text for who, e in self.events if who == label and isinstance(e, TextDelta))


def note_call(runtime: Runtime, trace: Texts, label: str) -> Job:
    """Key A's forced tool call, its long argument held to its schema by a grammar (a group of 11
    blocks, 15 own)."""
    request = {"messages": [{"role": "user", "content": "hi"}], "tools": [NOTE], "tool_choice": "required",
               "temperature": 0, "max_tokens": 200}
    made = runtime.service.prepare(ChatCompletionRequest.model_validate(request), tenant="tenant-a").job
    made.emit = trace.emitter(label)
    return made


def test_b_is_answered_while_a_holds_the_pool_with_long_generations(runtime_for: Callable[..., Runtime]) -> None:
    """A pool of 32 blocks of 16 tokens: key A's generation (6 blocks) and its tool call under a
    grammar (26) hold all of it; key B's request (4 blocks) is answered while A's are still
    decoding, not after one of them ends. A's youngest, preempted by recompute and resumed, writes
    what it writes alone, its grammar followed once per token (a valid call), its text sent once."""
    runtime = runtime_for("llama", ram_budget_bytes=TINY_KV_BYTES_PER_TOKEN * 512)
    assert runtime.engine.pool.num_blocks == 32
    trace = Texts()
    runtime.engine.submit(trace.job(runtime, "a0", "tenant-a", max_tokens=80))
    runtime.engine.submit(note_call(runtime, trace, "a1"))
    trace.wait_until(lambda: trace.count("a1", TextDelta) >= 2)  # both are decoding
    runtime.engine.submit(trace.job(runtime, "b", "tenant-b", max_tokens=30, seed=9))
    trace.wait("b")
    b_done = trace.index("b", Finished)
    assert not [who for who, e in trace.events[:b_done] if isinstance(e, Finished) and who != "b"]
    assert runtime.engine.stats().preemptions_total >= 1
    trace.wait("a0", "a1")
    alone = Texts()
    runtime.engine.submit(alone.job(runtime, "a0", "tenant-a", max_tokens=80))
    runtime.engine.submit(note_call(runtime, alone, "a1"))
    alone.wait("a0", "a1")
    for label in ("a0", "a1"):
        assert alone.tokens(label) == trace.tokens(label) and trace.count(label, Prefilled) == 1
        assert alone.text(label) == trace.text(label)
    assert trace.text("a1").startswith('{"text": "') and len(trace.text("a1")) > 400
