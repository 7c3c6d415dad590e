"""What every generation route (chat, responses, legacy completions, Messages) does around its
engine job: parse the body, take the API key's quota slot, prepare on the prepare threads, answer
whole (a client that hangs up cancels the job) or as server-sent events (the slot is given back
when the stream ends), with the `X-Toolkv-Cache` and `Server-Timing` headers of the job.

A streamed answer is the same for every API: wait for the answer's first event (the prompt is in)
or the client's hang-up (a 499, the job cancelled), then send each answer event as the API's wire
events. An error after the first byte ends the stream with the API's error events; a client that
hangs up mid-stream closes the answer, which cancels the generation (sse_starlette closes this one
generator, and it closes the service's). The chain from the engine to the wire is two async
generators deep per chunk: the service's `stream` (engine events to answer events,
gateway/serving/service.py) and `_sent` here (answer events to the API's events, by the API's
`WireEvents`, whose methods are plain calls). tests/api/test_streaming.py counts them."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse

from gateway.api.state import GatewayState, gateway_state
from gateway.edge.admission import Tenant
from gateway.edge.handlers import CLIENT_CLOSED_REQUEST, GONE, parse_object, unless_disconnected
from gateway.edge.handlers import validation_error as validation_error
from gateway.edge.limits import check_request_limits
from gateway.errors import APIError, ModelNotFound, error_envelope
from gateway.metrics import Metrics
from gateway.protocol.answer import AnswerEvent
from gateway.protocol.generation import GenerationRequest
from gateway.serving.answers import Prepared
from gateway.serving.runtime import Runtime

log = logging.getLogger(__name__)

BYPASS_HEADER = "x-toolkv-cache"
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
Release = Callable[[], None]


@dataclass(frozen=True, slots=True)
class Arrival:
    """A generation request as it reached its route: what preparing its job needs."""

    body: bytes
    runtime: Runtime
    state: GatewayState
    tenant: Tenant
    bypass: bool  # `X-Toolkv-Cache: bypass`
    received: float  # perf_counter at arrival: TTFT counts from here
    request_id: str

    def salt_for(self, group_id: str) -> str:
        return self.state.keyring.salt_for(self.tenant, group_id)


async def serve_generation(request: Request, request_id: str, prepare: Callable[[Arrival], T],
                           respond: Callable[[T, Release], Awaitable[Response]]) -> Response:
    """Check the key, hold one of its quota slots, run `prepare` on a prepare thread, then
    `respond`; a streamed response (an EventSourceResponse) gives the slot back when it ends."""
    received = time.perf_counter()
    state = gateway_state(request.app)
    request.state.request_id = request_id
    tenant = state.keyring.tenant(request)
    runtime = state.model.loaded()
    body = await request.body()  # already bounded by BodySizeLimit, after the key was checked
    bypass = request.headers.get(BYPASS_HEADER, "").lower() == "bypass"
    arrival = Arrival(body, runtime, state, tenant, bypass, received, request_id)
    release = state.quota.acquire(tenant.salt) if not state.keyring.open else no_release
    handed_off = False
    try:
        # in this key's turn: another key's backlog of expensive prepares does not queue ahead of it
        planned = await state.preparer.run(lambda: prepare(arrival), tenant=tenant.salt)
        response = await respond(planned, release)
        handed_off = isinstance(response, EventSourceResponse)
        return response
    finally:
        if not handed_off:
            release()


def prepare(arrival: Arrival, req: GenerationRequest) -> Prepared:
    """The engine job of a generation request (blocking: on a prepare thread), its errors naming
    the fields as its client wrote them. Every check here is cheap and bounded, and comes before
    the expensive render and tokenize."""
    check_request_limits(req, arrival.state.settings)
    check_model(arrival.runtime, req.model)
    return arrival.runtime.service.prepare(req, bypass=arrival.bypass, received=arrival.received,
                                           request_id=arrival.request_id, salt_for=arrival.salt_for,
                                           tenant=arrival.tenant.salt)


def check_model(runtime: Runtime, model: str | None) -> None:
    if model and model not in runtime.model_aliases:
        raise ModelNotFound(f"model '{model}' does not exist; this server serves '{runtime.model_name}'",
                            param="model")


async def whole_json(request: Request, runtime: Runtime, prepared: Prepared,
                     work: Awaitable[dict[str, Any]]) -> Response:
    """`work`'s body as JSON, or 499 (the job cancelled) when the client hangs up first."""
    with gateway_state(request.app).metrics.in_flight.track_inprogress():
        body = await unless_disconnected(request, work)
    if body is GONE:
        runtime.service.record_disconnect(prepared, stream=False)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(body, headers=prepared.response_headers())


def no_release() -> None:
    return None


# ---- request bodies ----------------------------------------------------------------------


def parse_model(body: bytes, model: type[M]) -> M:
    """`body` as `model`: a 400 naming the field (OpenAI's wording) when it is not one."""
    try:
        return model.model_validate(parse_object(body))
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


# ---- streamed answers ----------------------------------------------------------------------


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
    state = gateway_state(request.app)
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
