"""What every generation route (chat, responses, legacy completions) does around its engine job:
parse the body, take the API key's quota slot, prepare on the prepare threads, answer whole (a
client that hangs up cancels the job) or as server-sent events (the slot is given back when the
stream ends), with the `X-Toolkv-Cache` and `Server-Timing` headers of the job."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Gauge
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse

from gateway.edge.auth import KeyRing, Tenant
from gateway.edge.handlers import CLIENT_CLOSED_REQUEST as CLIENT_CLOSED_REQUEST
from gateway.edge.handlers import GENERATION_PATHS as GENERATION_PATHS
from gateway.edge.handlers import GONE as GONE
from gateway.edge.handlers import parse_object as parse_object
from gateway.edge.handlers import unless_disconnected as unless_disconnected
from gateway.edge.handlers import validation_error as validation_error
from gateway.edge.limits import check_request_limits
from gateway.errors import APIError, ModelNotFound, error_envelope
from gateway.metrics import Metrics
from gateway.protocol.chat import ChatCompletionRequest, in_request_terms
from gateway.serving.jobs import Prepared
from gateway.serving.runtime import Runtime, loaded_runtime

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
    state: Any  # the app's state: settings, keyring, response store
    tenant: Tenant
    bypass: bool  # `X-Toolkv-Cache: bypass`
    received: float  # perf_counter at arrival: TTFT counts from here
    request_id: str

    def salt_for(self, group_id: str) -> str:
        keyring: KeyRing = self.state.keyring
        return keyring.salt_for(self.tenant, group_id)


async def serve_generation(request: Request, request_id: str, prepare: Callable[[Arrival], T],
                           respond: Callable[[T, Release], Awaitable[Response]]) -> Response:
    """Check the key, hold one of its quota slots, run `prepare` on a prepare thread, then
    `respond`; a streamed response (an EventSourceResponse) gives the slot back when it ends."""
    received = time.perf_counter()
    state = request.app.state
    request.state.request_id = request_id
    tenant = state.keyring.tenant(request)
    runtime = loaded_runtime(state)
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


def prepare_chat(arrival: Arrival, req: ChatCompletionRequest) -> Prepared:
    """The engine job of a chat request (blocking: on a prepare thread). Every check here is
    cheap and bounded, and comes before the expensive render and tokenize."""
    runtime = arrival.runtime
    with in_request_terms(req):  # a legacy `functions` request's errors name `functions[i]`
        check_request_limits(req, arrival.state.settings)
        check_model(runtime, req.model)
        return runtime.service.prepare(req, bypass=arrival.bypass, received=arrival.received,
                                       request_id=arrival.request_id, salt_for=arrival.salt_for,
                                       tenant=arrival.tenant.salt)


def check_model(runtime: Runtime, model: str | None) -> None:
    if model and model not in runtime.model_aliases:
        raise ModelNotFound(f"model '{model}' does not exist; this server serves '{runtime.model_name}'",
                            param="model")


async def whole_json(request: Request, runtime: Runtime, prepared: Prepared,
                     work: Awaitable[dict[str, Any]]) -> Response:
    """`work`'s body as JSON, or 499 (the job cancelled) when the client hangs up first."""
    with request.app.state.metrics.in_flight.track_inprogress():
        body = await unless_disconnected(request, work)
    if body is GONE:
        runtime.service.record_disconnect(prepared, stream=False)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(body, headers=prepared.response_headers())


def sse_response(state: Any, prepared: Prepared, events: AsyncIterator[dict[str, str]],
                 release: Release) -> EventSourceResponse:
    """Send `events`; call once the job's first chunk is in hand (its headers are known then)."""
    return EventSourceResponse(tracked(state.metrics.in_flight, events, release), sep="\n", ping=15,
                               headers=prepared.response_headers(),
                               # past toolkv's own cut-off at the grace's end (edge/server.py GraceServer)
                               shutdown_grace_period=state.settings.shutdown_grace_s + 2)


async def sse_data(first: dict[str, Any] | None, chunks: AsyncIterator[dict[str, Any]], metrics: Metrics,
                   request_id: str) -> AsyncIterator[dict[str, str]]:
    """Chunks as `data:` events, an error after the first byte as an error envelope, then [DONE]."""
    if first is not None:
        yield {"data": orjson.dumps(first).decode()}
    try:
        async for chunk in chunks:
            yield {"data": orjson.dumps(chunk).decode()}
    except APIError as exc:
        yield {"data": orjson.dumps(exc.envelope()).decode()}
    except Exception:  # a bug after the first byte: end the stream with an error, count it
        log_stream_bug(metrics, request_id)
        yield {"data": orjson.dumps(error_envelope("internal server error", "server_error")).decode()}
    yield {"data": "[DONE]"}


def log_stream_bug(metrics: Metrics, request_id: str) -> None:
    log.exception("unhandled error in a stream", extra={"toolkv": {"request_id": request_id}})
    metrics.requests.labels(status="500", stream="true").inc()


async def tracked(gauge: Gauge, events: AsyncIterator[dict[str, str]],
                  release: Release) -> AsyncIterator[dict[str, str]]:
    try:
        with gauge.track_inprogress():
            async for event in events:
                yield event
    finally:
        release()


def no_release() -> None:
    return None


# ---- request bodies ----------------------------------------------------------------------


def parse_model(body: bytes, model: type[M]) -> M:
    """`body` as `model`: a 400 naming the field (OpenAI's wording) when it is not one."""
    try:
        return model.model_validate(parse_object(body))
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
