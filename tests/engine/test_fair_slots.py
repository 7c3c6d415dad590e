"""Fair slots (gateway/engine/scheduler.py): while another tenant waits, no key holds more than its
share of the batch. Key A's long generations fill every slot; key B's request takes the slot of
A's youngest decoding sequence, which is paused (its KV and text kept) and resumes where it
stopped. Model-free tests pin the admission order, in the manner of vLLM's tests/v1/core; one
engine test on a tiny model shows what a user notices: B's 1-token answer comes while A's
generations are still running, and A's tokens are what they are alone."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from gateway.engine import Finished, Job, Prefilled, TextDelta
from gateway.engine.cache_manager import HOLD, Hold, KVCacheManager, Placement
from gateway.engine.sampling import SamplingParams
from gateway.engine.scheduler import Scheduler
from gateway.engine.sequence import Phase, Sequence
from gateway.serving.runtime import Runtime
from tests.engine.test_tenant_fairness import Trace


@dataclass
class Slot:
    """What admission reads of a running sequence (its job and its phase), and the step planner
    (its next chunk)."""

    job: Job
    phase: Phase = Phase.PROMPT
    remaining_prefill: int = 3
    last_step: int = 0

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
