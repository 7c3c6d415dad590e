"""A job's way into the engine and out of it. What goes in: a Job; a WarmGroup, a tool group to
cache; or a Task to run on the engine's thread. The inbox they wait in (`Intake`): put from any
thread (at most `max_queue` waiting in the engine, counting what the scheduler holds: QueueFull
past that), taken by the engine thread between steps, in the order they came; what happens to
them after is the scheduler's (scheduler.py) and the engine's (a task runs on its thread). What
comes out of a job: events, in order (Prefilled, TextDelta..., then Finished or Failed), read
from its `JobStream` (as vLLM's `add_request` returns the request's output collector): the engine
thread puts each event in, the submitting event loop reads them out, and whoever reads them ends
the job by closing the stream.

`Intake.put`, `close` and `depth` from any thread; `take` on the engine thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from gateway.engine.sampling import SamplingParams, TokenLogprob
from gateway.kvcache.entry import CacheEntry, PrefixKey

if TYPE_CHECKING:
    from gateway.engine.constraints import Constraint

CacheResult = Literal["hit", "miss", "bypass", "skip"]


@dataclass(frozen=True, slots=True)
class Prefilled:
    prompt_tokens: int
    cached_tokens: int
    result: CacheResult
    tier: str | None
    restore_s: float
    compile_s: float
    prefill_s: float  # from admission to the first token's logits: lookup, compile, prompt chunks
    forward_s: float = 0.0  # the model's own forward passes over the prompt after the group
    queued_s: float = 0.0  # from submit until the engine admitted the job
    lookup_s: float = 0.0  # key hash + cache lookup


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    # When the job asked for them, the logprobs of the tokens whose text ends in this delta (the
    # stream may hold text back: half a character, a possible stop sequence), see HeldLogprobs.
    logprobs: tuple[TokenLogprob, ...] = ()
    tokens: int = 0  # generated so far (a client that leaves before the end is counted with them)


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: Literal["stop", "length"]
    completion_tokens: int
    token_ids: tuple[int, ...] = ()
    stop_sequence: str | None = None  # the job's stop string that ended it, if one did


@dataclass(frozen=True, slots=True)
class Failed:
    message: str
    param: str | None = None  # set when the request is at fault (its schema ran the grammar past a limit): a 400
    shutting_down: bool = False  # cut off at the end of the shutdown grace period: a 503 the client may retry


EngineEvent = Prefilled | TextDelta | Finished | Failed


def _drop(event: EngineEvent) -> None:
    return None


@dataclass(slots=True)
class Job:
    prompt_ids: list[int]
    prefix_len: int  # tokens of the tool group; 0 when there is none
    params: SamplingParams
    # a sink of its own besides the stream Engine.submit returns (engine tests, the bench's floor);
    # called on the engine thread
    emit: Callable[[EngineEvent], None] = _drop
    use_cache: bool = True
    salt: str = ""  # the group's cache namespace ("" for a group listed in shared_groups)
    tenant: str = ""  # the tenant's own namespace: conversation KV is never shared between tenants
    group_id: str = ""
    tool_names: tuple[str, ...] = ()
    retention_s: float = 0.0  # keep the tool group cached at least this long (prompt_cache_retention); 0: LRU
    keep_token_ids: frozenset[int] = frozenset()  # special tokens the output text must keep
    constraint: Constraint | None = None  # the grammar its output follows (constraints.py)
    # Stop sequences apply only to the text before this, a tool call section's trigger: a call the
    # grammar holds to its schema is never cut into invalid arguments. "": the output starts inside
    # a call (a forced one), so they never apply; None: they apply to all of it.
    stop_before: str | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = 0.0  # perf_counter at submit


class WarmUpFailed(Exception):
    """Computing a warmed group failed (the server log has why)."""


@dataclass(slots=True)
class WarmGroup:
    """A tool group to cache, not a generation (`toolkv cache warm`, `warm_groups` at start,
    `POST /v1/cache/warm`): found in RAM or on disk, or computed into the store in chunks between
    other requests' steps. `future` gets the entry and whether it was cached already.

    The cache manager answers it on its own path (`KVCacheManager.place_group`); computing it is
    `job`'s: a prompt that is all group and asks for no tokens, so it ends once its group is stored
    (outputs.py). A failure reaches `future` through that job's events."""

    key: PrefixKey  # in the shared namespace
    group_id: str = ""
    tool_names: tuple[str, ...] = ()
    future: Future[tuple[CacheEntry, bool]] = field(default_factory=Future)
    job: Job = field(init=False)

    def __post_init__(self) -> None:
        self.job = Job(list(self.key.token_ids), len(self.key.token_ids), SamplingParams(max_tokens=0),
                       emit=self._report, group_id=self.group_id, tool_names=self.tool_names)

    def _report(self, event: EngineEvent) -> None:
        if isinstance(event, Failed) and not self.future.done():
            self.future.set_exception(WarmUpFailed(event.message))


class QueueFull(Exception):
    """Too many jobs are waiting; retry later."""


class TooLarge(Exception):
    """The job needs more KV blocks than the whole pool has: it can never run."""


class CutOff(Exception):
    """The shutdown grace period ran out while the job was still generating."""


@dataclass(slots=True)
class Task:
    """Work other than a generation that must run on the engine thread (e.g. listing)."""

    fn: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)


Work = Job | WarmGroup | Task


# ---- the inbox ---------------------------------------------------------------------------------

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


# ---- a job's events, out ------------------------------------------------------------------------

EventSink = Callable[[EngineEvent], None]


class JobStream:
    """The job's events in order, read with `async for` (it ends after `Finished` or `Failed`);
    `aclose` stops the job wherever it is (a no-op once it finished). `prefilled` is the engine's
    prefill report once it was made. Not a generator: reading an event is one `await`, no frames
    stacked (docs/architecture.md, the streamed request's path)."""

    def __init__(self, job: Job, abort: Callable[[Job], None], forward: EventSink | None = None) -> None:
        self.job = job
        self.prefilled: Prefilled | None = None
        self._abort = abort
        self._forward = forward  # a job submitted with its own sink (engine tests, the bench's floor)
        self._inbox: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self._ended = False
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # submitted from a thread with no loop: read through `forward` only
            self._loop = None

    def put(self, event: EngineEvent) -> None:
        """Called on the engine thread: must never raise there."""
        if isinstance(event, Prefilled):
            self.prefilled = event
        if self._forward is not None:
            self._forward(event)
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._inbox.put_nowait, event)
        except RuntimeError:  # the reader's loop is closed: nobody reads this job any more
            self._abort(self.job)

    def __aiter__(self) -> JobStream:
        return self

    async def __anext__(self) -> EngineEvent:
        if self._ended:
            raise StopAsyncIteration
        event = await self._inbox.get()
        self._ended = isinstance(event, (Finished, Failed))
        return event

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop the job (it frees its blocks); a no-op once it finished."""
        self._ended = True
        self._abort(self.job)
