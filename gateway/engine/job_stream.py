"""A submitted job's events, as `Engine.submit` returns them (as vLLM's `add_request` returns the
request's output collector): the engine thread puts each event in, the submitting event loop
reads them out, and whoever reads them ends the job by closing the stream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.engine.events import EngineEvent, Failed, Finished, Job, Prefilled

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
