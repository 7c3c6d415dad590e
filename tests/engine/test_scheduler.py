"""The scheduler as the one owner of the batch (gateway/engine/scheduler.py), without a model:
what `schedule()` answers, and how a sequence leaves (`retire`) or starts again (`restart`). The
admission order between tenants is pinned in tests/engine/test_fair_slots.py."""

from __future__ import annotations

from typing import cast

from gateway.engine.cache_manager import Hold, Placement
from gateway.engine.events import Job
from gateway.engine.sequence import Phase
from tests.engine.test_fair_slots import Batch, held, names


class Refusing(Batch):
    """A batch whose placement raises for the jobs named `bad`."""

    def __init__(self, max_batch: int, bad: str) -> None:
        super().__init__(max_batch)
        placer = self.scheduler.cache

        def admit(job: Job, recompute: bool = False) -> Placement | Hold | None:
            if job.group_id == bad:
                raise ValueError("the schema ran past a limit")
            return cast(Placement, object())

        placer.admit = admit  # type: ignore[method-assign]


def test_a_job_whose_placement_raises_comes_back_refused_and_the_next_takes_its_slot() -> None:
    batch = Refusing(max_batch=1, bad="a0")
    batch.hold("a", "a0", "a1")
    plan = batch.scheduler.schedule()
    assert [(job.group_id, str(exc)) for job, exc in plan.refused] == [("a0", "the schema ran past a limit")]
    assert names(batch.running) == ["a1"] and held(batch) == []


def test_a_cancelled_sequence_leaves_before_admission_so_a_waiting_job_takes_its_slot_at_once() -> None:
    batch = Batch(max_batch=1)
    batch.hold("a", "a0", "a1")
    batch.admit()
    batch.running[0].job.cancelled.set()
    plan = batch.scheduler.schedule()
    assert names(batch.running) == ["a1"] and batch.scheduler.num_cancelled == 1
    assert [seq.job.group_id for seq, _, _ in plan.prefill] == ["a1"]


def test_a_restarted_sequence_that_does_not_fit_waits_ahead_of_every_job() -> None:
    fits = {"a0", "a1", "a2"}
    batch = Batch(max_batch=2, fits=lambda job: job.group_id in fits)
    batch.hold("a", "a0", "a1", "a2")
    batch.admit()
    fits.discard("a0")  # its group must be computed again, and the pool is full now
    batch.scheduler.restart(batch.running[0])
    assert names(batch.running) == ["a1"] and held(batch) == ["a0", "a2"]


def test_retiring_twice_gives_the_blocks_back_once() -> None:
    released: list[str] = []
    batch = Batch(max_batch=2)
    batch.hold("a", "a0")
    batch.admit()
    seq = batch.running[0]
    seq.release = lambda: released.append(seq.job.group_id)  # type: ignore[method-assign]
    batch.scheduler.retire(seq)
    batch.scheduler.retire(seq)
    assert released == ["a0"] and batch.running == []


def test_the_step_plan_is_made_over_the_batch_after_admission() -> None:
    batch = Batch(max_batch=2)
    batch.hold("a", "a0", "a1", "a2")
    plan = batch.scheduler.schedule()
    assert [seq.job.group_id for seq, _, _ in plan.prefill] == ["a0", "a1"] and not plan.decode
    for seq in batch.running:
        seq.phase = Phase.DECODE
    plan = batch.scheduler.schedule()
    assert names(plan.decode) == ["a0", "a1"] and held(batch) == ["a2"]
