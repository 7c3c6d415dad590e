"""Where work waits before the engine runs it: the intake queue (jobs and tasks put from any
thread, at most `max_queue` waiting: QueueFull past that), the jobs taken off it that are not
running yet (`held`), and the order held jobs are admitted in.

Admission is fair between tenants: a free batch slot goes to the held job of the tenant with the
fewest sequences running, counting the jobs admitted before it in the same pass (ties: the oldest
job), so one key's backlog delays another key's request by one slot, not by the whole backlog.
Engine thread only, but for `put` and `depth`.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterable

from gateway.engine.cache_manager import HOLD, Hold
from gateway.engine.events import Job, QueueFull, Task
from gateway.engine.sequence import Sequence

IDLE_WAIT_S = 0.05  # a held job with nothing running re-checks the pool this often


class Intake:
    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._queue: queue.Queue[Job | Task | None] = queue.Queue()
        self.held: list[Job] = []  # taken off the queue, not admitted yet, oldest first
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
        """Jobs and tasks accepted, not yet running (read from any thread: a snapshot)."""
        return self._queue.qsize() + len(self.held)

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
        idle (nothing running, nothing held). False once the engine is told to stop."""
        wait = not running
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
        """Admit held jobs into `running` while it has fewer than `max_batch` sequences, fairest
        first: `admit_one` makes a job's sequence (HOLD: it does not fit yet, None: nothing to
        run); a job it raises for is failed (`fail`) and forgotten."""
        self.held[:] = [job for job in self.held if not job.cancelled.is_set()]
        for job in self.admission_order(seq.job.tenant for seq in running):
            if len(running) >= max_batch:
                return
            try:
                seq = admit_one(job)
            except Exception as exc:
                self.held.remove(job)
                fail(job, exc)
                continue
            if seq is HOLD:
                continue
            self.held.remove(job)
            if seq is not None:
                running.append(seq)

    def admission_order(self, running_tenants: Iterable[str]) -> list[Job]:
        """The held jobs, fairest first: round robin over tenants, fewest running first."""
        turns = Counter(running_tenants)
        ranked = []
        for index, job in enumerate(self.held):
            ranked.append((turns[job.tenant], index, job))
            turns[job.tenant] += 1
        return [job for _, _, job in sorted(ranked, key=lambda r: r[:2])]

    def hold_first(self, job: Job) -> None:
        """Hold `job` ahead of every other (a sequence restarted after a bad cached group)."""
        self.held.insert(0, job)
