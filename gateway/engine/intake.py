"""Where work waits before the engine runs it: the intake queue (jobs and tasks put from any
thread, at most `max_queue` waiting: QueueFull past that), the jobs taken off it that are not
running yet (`held`), the sequences paused for another tenant's share (`paused`), and the order
they are admitted in.

Admission is fair between tenants: a free batch slot goes to the held job of the tenant with the
fewest sequences running, counting the jobs admitted before it in the same pass (ties: the oldest
job), so one key's backlog delays another key's request by one slot, not by the whole backlog.

Fair slots: while another tenant waits, no tenant holds more than its share of the batch,
`max_batch // tenants` (tenants: those with work running, held or paused; one slot at least). A
tenant below its share whose work finds the batch full takes the slot of the youngest decoding
sequence of the tenant furthest above its share. That sequence is paused, not dropped: it keeps
its KV blocks, sampler and text, leaves the batch and resumes where it stopped when a slot is free
and it is its tenant's turn (a tenant's paused sequences before its held jobs: they are older). So
a key with many long generations delays another key's request by a step, never by a generation,
and no work is lost or done twice. Chosen over a cap on each tenant's running sequences at
admission: a cap cannot know that a second tenant will come, so it either leaves slots idle while
one tenant is alone or still makes a newcomer wait for a generation to end. What pausing does not
give: a paused sequence keeps its blocks, so a newcomer that does not fit the pool waits (HOLD) as
before; only decoding sequences are paused (a prompt may be compiling a group others wait for); and
with fewer slots than tenants (`max_batch` 1) a tenant keeps its slot until its row ends. Pauses
are counted (`num_paused`: `vllm:num_preemptions_total`); tests/engine/test_fair_slots.py.

Engine thread only, but for `put` and `depth`.
"""
from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterable

from gateway.engine.cache_manager import HOLD, Hold
from gateway.engine.events import Job, QueueFull, Task
from gateway.engine.sequence import Phase, Sequence

IDLE_WAIT_S = 0.05  # a held job with nothing running re-checks the pool this often


class Intake:
    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._queue: queue.Queue[Job | Task | None] = queue.Queue()
        self.held: list[Job] = []  # taken off the queue, not admitted yet, oldest first
        self.paused: list[Sequence] = []  # out of the batch for another tenant's share, oldest first
        self.num_paused = 0  # sequences paused since start (the engine's preemptions)
        self._tasks = 0  # tasks and stops queued, not taken yet
        self._tasks_lock = threading.Lock()

    @property
    def tasks_waiting(self) -> bool:
        """Whether a task or a stop is queued (read from the engine thread)."""
        return self._tasks > 0

    def _count_task(self, delta: int) -> None:
        with self._tasks_lock:
            self._tasks += delta

    @property
    def depth(self) -> int:
        """Jobs and tasks accepted, not yet running, and sequences paused (read from any thread: a
        snapshot)."""
        return self._queue.qsize() + len(self.held) + len(self.paused)

    def put(self, item: Job | Task) -> None:
        """Queue `item` (any thread); QueueFull when `max_queue` wait already."""
        if self.depth >= self.max_queue:
            raise QueueFull
        if isinstance(item, Task):
            self._count_task(1)
        self._queue.put_nowait(item)

    def close(self) -> None:
        """Tell the engine thread to stop (after what is queued before)."""
        self._count_task(1)
        self._queue.put(None)

    def take(self, running: bool, run_task: Callable[[Task], None]) -> bool:
        """Move everything queued to `held`, running tasks as they come; block while the engine is
        idle (nothing running, held or paused). False once the engine is told to stop."""
        wait = not running and not self.paused
        while True:
            try:
                if wait and not self.held:
                    item = self._queue.get()
                elif wait:
                    item = self._queue.get(timeout=IDLE_WAIT_S)
                else:
                    item = self._queue.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                self._count_task(-1)
                return False
            if isinstance(item, Task):
                self._count_task(-1)
                run_task(item)
                wait = wait and not self.held
            else:
                wait = False
                if not item.cancelled.is_set():
                    self.held.append(item)

    def admit(self, running: list[Sequence], max_batch: int, admit_one: Callable[[Job], Sequence | Hold | None],
              fail: Callable[[Job, Exception], None]) -> None:
        """Admit held jobs and resume paused sequences into `running`, fairest first, while it has
        fewer than `max_batch` sequences, or by pausing a sequence of a tenant above its share (see
        the module doc): `admit_one` makes a job's sequence (HOLD: it does not fit yet, None:
        nothing to run); a job it raises for is failed (`fail`) and forgotten. A paused sequence
        whose client went away is put back in `running`, for the engine to drop at once."""
        self.held[:] = [job for job in self.held if not job.cancelled.is_set()]
        for item in self.admission_order(seq.job.tenant for seq in running):
            victim = None
            if len(running) >= max_batch:
                victim = self._victim(running, max_batch, _tenant(item))
                if victim is None:
                    continue
            if not isinstance(item, Job):  # a paused sequence
                self.paused.remove(item)
                running.append(item)
            elif not self._admit_job(item, running, admit_one, fail):
                continue
            if victim is not None:
                self._pause(victim, running)
        gone = [seq for seq in self.paused if seq.job.cancelled.is_set()]
        self.paused[:] = [seq for seq in self.paused if not seq.job.cancelled.is_set()]
        running.extend(gone)

    def _admit_job(self, job: Job, running: list[Sequence], admit_one: Callable[[Job], Sequence | Hold | None],
                   fail: Callable[[Job, Exception], None]) -> bool:
        """Whether `job` took a slot (or failed, or had nothing to run: it is no longer held)."""
        try:
            seq = admit_one(job)
        except Exception as exc:
            self.held.remove(job)
            fail(job, exc)
            return False
        if seq is HOLD:
            return False
        self.held.remove(job)
        if seq is None:
            return False
        running.append(seq)
        return True

    def admission_order(self, running_tenants: Iterable[str]) -> list[Job | Sequence]:
        """The paused sequences and held jobs, fairest first: round robin over tenants, fewest
        running first; a tenant's paused sequences before its held jobs."""
        turns = Counter(running_tenants)
        ranked = []
        for index, item in enumerate(self._waiting()):
            ranked.append((turns[_tenant(item)], index, item))
            turns[_tenant(item)] += 1
        return [item for _, _, item in sorted(ranked, key=lambda r: r[:2])]

    def waiting_turn(self, running: list[Sequence], max_batch: int) -> bool:
        """Whether something waits that could run now: a task, a job not taken yet (its tenant is
        not known), a free slot for held or paused work, or a tenant below its share while another
        is above it (the engine stops launching steps ahead for it)."""
        if self.tasks_waiting or self._queue.qsize():
            return True
        waiting = {_tenant(item) for item in self._waiting()}
        if waiting and len(running) < max_batch:
            return True
        return any(self._victim(running, max_batch, tenant) is not None for tenant in waiting)

    def resume_all(self, running: list[Sequence]) -> None:
        """Every paused sequence back in `running` (the engine stops, or cuts every generation off)."""
        running.extend(self.paused)
        self.paused.clear()

    def _waiting(self) -> list[Job | Sequence]:
        return [*self.paused, *self.held]

    def _share(self, running: list[Sequence], max_batch: int) -> int:
        """Each tenant's share of the batch: its slots over the tenants with work."""
        tenants = {seq.job.tenant for seq in running} | {_tenant(item) for item in self._waiting()}
        return max(1, max_batch // max(1, len(tenants)))

    def _victim(self, running: list[Sequence], max_batch: int, tenant: str) -> Sequence | None:
        """The sequence to pause so that `tenant` gets a slot of a full batch: the youngest decoding
        one of the tenant furthest above its share that has one; None when `tenant` has its share
        already, or no tenant above its share is decoding."""
        counts = Counter(seq.job.tenant for seq in running)
        share = self._share(running, max_batch)
        if counts[tenant] >= share:
            return None
        for over in (t for t, count in counts.most_common() if count > share):
            decoding = [seq for seq in running if seq.job.tenant == over and seq.phase is Phase.DECODE]
            if decoding:
                return max(decoding, key=lambda seq: seq.job.submitted)
        return None

    def _pause(self, seq: Sequence, running: list[Sequence]) -> None:
        running.remove(seq)
        self.paused.append(seq)
        self.paused.sort(key=lambda s: s.job.submitted)
        self.num_paused += 1

    def hold_first(self, job: Job) -> None:
        """Hold `job` ahead of every other (a sequence restarted after a bad cached group)."""
        self.held.insert(0, job)


def _tenant(item: Job | Sequence) -> str:
    return item.tenant if isinstance(item, Job) else item.job.tenant
