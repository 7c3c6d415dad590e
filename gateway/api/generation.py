"""What every generation route (chat, responses, legacy completions) does around its engine job:
parse the body, take the API key's quota slot, prepare on the prepare threads, answer whole (a
client that hangs up cancels the job) or as server-sent events (the slot is given back when the
stream ends), with the `X-Toolkv-Cache` and `Server-Timing` headers of the job."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse

from gateway.edge.auth import KeyRing, Tenant
from gateway.edge.handlers import CLIENT_CLOSED_REQUEST, GONE, parse_object, unless_disconnected
from gateway.edge.handlers import validation_error as validation_error
from gateway.edge.limits import check_request_limits
from gateway.errors import ModelNotFound
from gateway.protocol.generation import GenerationRequest
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
    with request.app.state.metrics.in_flight.track_inprogress():
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
