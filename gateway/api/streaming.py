"""A streamed answer as server-sent events, the same for every API (chat, completions, Messages,
Responses): wait for the answer's first event (the prompt is in) or the client's hang-up (a 499,
the job cancelled), then send each answer event as the API's wire events. An error after the
first byte ends the stream with the API's error events; a client that hangs up mid-stream closes
the answer, which cancels the generation (sse_starlette closes this one generator, and it closes
the service's).

The chain from the engine to the wire is two async generators deep per chunk: the service's
`stream` (engine events to answer events, gateway/serving/service.py) and `_sent` here (answer
events to the API's events, by the API's `WireEvents`, whose methods are plain calls).
tests/api/test_streaming.py counts them."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse

from gateway.edge.handlers import CLIENT_CLOSED_REQUEST, GONE, unless_disconnected
from gateway.errors import APIError, error_envelope
from gateway.metrics import Metrics
from gateway.protocol.answer import AnswerEvent
from gateway.serving.jobs import Prepared

log = logging.getLogger(__name__)

Release = Callable[[], None]
SSE = dict[str, str]  # one server-sent event: `data`, and `event` when the API names its events


class WireEvents:
    """One API's side of a stream: its events for each answer event, and how it ends. Plain
    calls: no generator of their own."""

    def of(self, event: AnswerEvent) -> list[SSE]:
        """The API's events for `event`."""
        raise NotImplementedError

    def failed(self, error: APIError) -> list[SSE]:
        """The API's error events for an error after the first byte."""
        raise NotImplementedError

    def broken(self) -> list[SSE]:
        """The API's error events for a bug after the first byte (logged and counted already)."""
        raise NotImplementedError

    def done(self) -> list[SSE]:
        """The last events, after the answer's (or the error's): none unless the API has some."""
        return []

    def close(self) -> None:
        """The stream is over: ended, failed or cut off by a hang-up."""


async def stream_answer(request: Request, prepared: Prepared, answer: AsyncGenerator[AnswerEvent],
                        wire: WireEvents, release: Release) -> Response:
    """The answer as server-sent events with the job's headers, or 499 when the client leaves
    before its first event (the job cancelled; the service records the 499). Errors before the
    first event (a full queue) are plain HTTP errors. `release` gives the key's quota slot back
    once the stream is over."""
    state = request.app.state
    # a client that leaves while its stream is still queued cancels it too
    first = await unless_disconnected(request, anext(answer))
    if first is GONE:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    events = _sent(first, answer, wire, state.metrics, prepared.request_id, release)
    return EventSourceResponse(events, sep="\n", ping=15, headers=prepared.response_headers(),
                               # past toolkv's own cut-off at the grace's end (edge/server.py GraceServer)
                               shutdown_grace_period=state.settings.shutdown_grace_s + 2)


async def _sent(first: AnswerEvent, answer: AsyncGenerator[AnswerEvent], wire: WireEvents, metrics: Metrics,
                request_id: str, release: Release) -> AsyncIterator[SSE]:
    try:
        with metrics.in_flight.track_inprogress():
            try:
                for sse in wire.of(first):
                    yield sse
                async for event in answer:
                    for sse in wire.of(event):
                        yield sse
            except APIError as exc:
                for sse in wire.failed(exc):
                    yield sse
            except Exception:  # a bug after the first byte: end the stream with an error, count it
                log.exception("unhandled error in a stream", extra={"toolkv": {"request_id": request_id}})
                metrics.requests.labels(status="500", stream="true").inc()
                for sse in wire.broken():
                    yield sse
            for sse in wire.done():
                yield sse
    finally:
        await answer.aclose()  # a hang-up mid-stream: the service records it and cancels the job
        wire.close()
        release()


def data(event: dict[str, Any]) -> SSE:
    """An unnamed event (chat, completions: `data: {...}`)."""
    return {"data": orjson.dumps(event).decode()}


def named(event: dict[str, Any]) -> SSE:
    """An event named by its `type` (Messages, Responses: `event: ...` then `data: {...}`)."""
    return {"event": event["type"], "data": orjson.dumps(event).decode()}


class ChunkWire(WireEvents):
    """OpenAI's chat and completions streams: each chunk a `data:` event, an error after the first
    byte its error envelope, then `data: [DONE]` whatever happened."""

    def __init__(self, chunks: Callable[[AnswerEvent], list[dict[str, Any]]]) -> None:
        self.chunks = chunks

    def of(self, event: AnswerEvent) -> list[SSE]:
        return [data(chunk) for chunk in self.chunks(event)]

    def failed(self, error: APIError) -> list[SSE]:
        return [data(error.envelope())]

    def broken(self) -> list[SSE]:
        return [data(error_envelope("internal server error", "server_error"))]

    def done(self) -> list[SSE]:
        return [{"data": "[DONE]"}]
