"""The engine's inbox: jobs, warm-ups and tasks put from any thread (at most `max_queue` waiting in the
engine, counting what the scheduler holds: QueueFull past that), taken by the engine thread between
steps, in the order they came. What happens to them after is the scheduler's (scheduler.py) and
the engine's (a task runs on its thread).

`put`, `close` and `depth` from any thread; `take` on the engine thread.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

from gateway.engine.events import Job, QueueFull, Task, WarmGroup

Work = Job | WarmGroup | Task

IDLE_WAIT_S = 0.05  # a waiting job with nothing running re-checks the pool this often


class Intake:
    def __init__(self, max_queue: int, held: Callable[[], int] = lambda: 0) -> None:
        self.max_queue = max_queue
        self._held = held  # how many the engine took and holds, not running (a snapshot)
        self._queue: queue.Queue[Work | None] = queue.Queue()
        self._tasks = 0  # tasks and stops queued, not taken yet
        self._tasks_lock = threading.Lock()
        self.closed = False  # the engine was told to stop (set when the stop is taken)

    @property
    def busy(self) -> bool:
        """Whether anything is queued, not taken yet (read from the engine thread)."""
        return self._tasks > 0 or self._queue.qsize() > 0

    @property
    def depth(self) -> int:
        """Jobs and tasks accepted and not running yet (read from any thread: a snapshot)."""
        return self._queue.qsize() + self._held()

    def put(self, item: Work) -> None:
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

    def take(self, idle: bool, holding: bool) -> Iterator[Work]:
        """Everything queued, in order (cancelled jobs left out); blocks while the engine is `idle`
        (nothing running or paused) until something comes, re-checking every `IDLE_WAIT_S` while
        it is `holding` jobs that wait for blocks. Ends at a stop, setting `closed`."""
        wait = idle
        while True:
            try:
                if wait and not holding:
                    item = self._queue.get()
                elif wait:
                    item = self._queue.get(timeout=IDLE_WAIT_S)
                else:
                    item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self._count_task(-1)
                self.closed = True
                return
            if isinstance(item, Task):
                self._count_task(-1)
                wait = wait and not holding
                yield item
            else:
                wait = False
                if isinstance(item, WarmGroup) or not item.cancelled.is_set():
                    holding = True
                    yield item

    def _count_task(self, delta: int) -> None:
        with self._tasks_lock:
            self._tasks += delta
