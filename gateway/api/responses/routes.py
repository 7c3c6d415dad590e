"""`POST /v1/responses`: OpenAI's Responses API, whole and streamed, run as the generation request
it amounts to (gateway/protocol/responses.py) through the chat service, so tool groups, conversation reuse,
keys, quotas and the cache headers work exactly as for chat. `previous_response_id` continues a
response kept in this tenant's ResponseStore (`store: false` keeps nothing), which
responses_retrieval.py reads back. A response exists from its first event: while it runs, GET reads
it `in_progress` and DELETE forgets it for good (it is not kept when it ends)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from gateway.api.generation import (
    SSE,
    Arrival,
    Release,
    WireEvents,
    named,
    parse_model,
    prepare,
    serve_generation,
    stream_answer,
    whole_json,
)
from gateway.api.responses.retrieval import listed_items
from gateway.api.responses.retrieval import router as retrieval_router
from gateway.api.responses.store import ResponseStore, StoredResponse, Turn
from gateway.api.responses.stream import ResponseEvents
from gateway.api.state import GatewayState, gateway_state
from gateway.errors import APIError, BadRequest, GenerationFailed
from gateway.protocol.answer import AnswerEvent, Ended, Started
from gateway.protocol.responses import ResponsesRequest, input_messages, to_generation
from gateway.protocol.responses_output import (
    ResponseShape,
    assistant_turn,
    new_response_id,
    output_of,
    status_of,
    usage_of,
)
from gateway.serving.answers import Prepared
from gateway.serving.runtime import Runtime

router = APIRouter()


def install(app: FastAPI, state: GatewayState) -> None:
    """The routes, and the gauges of the store `previous_response_id` and GET read (`state.responses`,
    sized by `max_stored_responses`, `max_stored_response_bytes` per key and
    `max_stored_response_bytes_total`): its bytes and budgets."""
    settings, store = state.settings, state.responses
    state.metrics.responses_store_bytes.set_function(lambda: store.num_bytes)
    budgets = state.metrics.memory_budget_bytes
    budgets.labels(structure="responses_store").set(settings.max_stored_response_bytes_total)
    budgets.labels(structure="responses_store_per_key").set(settings.max_stored_response_bytes)
    app.include_router(router)
    app.include_router(retrieval_router)


@dataclass(frozen=True, slots=True)
class Planned:
    """A Responses request ready to run: its chat job, and what its response and store need."""

    req: ResponsesRequest
    prepared: Prepared
    shape: ResponseShape
    tenant: str
    turn: list[dict[str, Any]]  # the chat messages this request's input adds to the conversation
    parent: Turn | None
    items: tuple[dict[str, Any], ...]  # its input as listed items (what `input_items` reads back)


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    async def respond(planned: Planned, release: Release) -> Response:
        state = gateway_state(request.app)
        runtime, store = state.model.loaded(), state.responses
        if not planned.req.stream:
            return await whole_json(request, runtime, planned.prepared, _whole(runtime, planned, store))
        return await _streamed(request, runtime, planned, store, release)

    return await serve_generation(request, new_response_id(), _plan, respond)


def _plan(arrival: Arrival) -> Planned:
    """Parse, continue the previous response, turn into a generation request and prepare (a prepare
    thread)."""
    req = parse_model(arrival.body, ResponsesRequest)
    parent = _previous(arrival, req.previous_response_id)
    turn = input_messages(req.input)
    items = listed_items(req.input)
    if req.store is not False:
        _check_room(arrival.state.responses, parent, len(orjson.dumps(turn)) + len(orjson.dumps(items)))
    conversation = (parent.conversation() if parent is not None else []) + turn
    if not conversation:
        raise BadRequest("'input' is required: send text or a list of input items", param="input")
    prepared = prepare(arrival, to_generation(req, conversation))
    shape = ResponseShape.of(arrival.request_id, req, arrival.runtime.model_name)
    return Planned(req, prepared, shape, arrival.tenant.salt, turn, parent, items)


def _previous(arrival: Arrival, response_id: str | None) -> Turn | None:
    if response_id is None:
        return None
    stored = arrival.state.responses.get(arrival.tenant.salt, response_id)  # another tenant's id is not found either
    if stored is None:
        raise BadRequest(f"Previous response with id '{response_id[:100]}' not found.",
                         param="previous_response_id", code="previous_response_not_found")
    return stored.turn


def _check_room(store: ResponseStore, parent: Turn | None, added: int) -> None:
    """A 400 before any work for a response that could never be kept: the chain of turns it
    continues and what its input adds (`added` bytes: its turn and its listed items) are alone
    over the store's budget for a key."""
    if store.keeps_nothing or store.fits(parent, added):
        return
    param = "previous_response_id" if parent is not None else "input"
    raise BadRequest(f"this conversation is too large to store: it would be over the {store.budget} bytes "
                     "(max_stored_response_bytes) this server keeps per API key; send 'store': false, or "
                     "start a new conversation", param=param, code="conversation_too_large")


async def _whole(runtime: Runtime, planned: Planned, store: ResponseStore) -> dict[str, Any]:
    _begin(store, planned)
    try:
        answer = await runtime.service.complete(planned.prepared)  # its errors name Responses fields already
        body = planned.shape.body(status_of(answer.finish_reason), output_of(answer), usage_of(answer.usage))
        _keep(store, planned, body)
        return body
    finally:
        store.end(planned.tenant, planned.shape.response_id)


async def _streamed(request: Request, runtime: Runtime, planned: Planned, store: ResponseStore,
                    release: Release) -> Response:
    wire = _ResponsesWire(planned, store)
    return await stream_answer(request, planned.prepared, runtime.service.stream(planned.prepared), wire, release)


class _ResponsesWire(WireEvents):
    """The answer's Responses events; the response is stored as it ends, failed or not, before
    the client sees it end."""

    def __init__(self, planned: Planned, store: ResponseStore) -> None:
        self.planned, self.store = planned, store
        self.stream = ResponseEvents(planned.shape)

    def of(self, event: AnswerEvent) -> list[SSE]:
        if isinstance(event, Started):  # before `response.created` is sent: a GET or DELETE may follow it
            _begin(self.store, self.planned)
        if not isinstance(event, Ended):
            return [named(e) for e in self.stream.feed(event)]
        events, body = self.stream.finish(event)
        _keep(self.store, self.planned, body)  # kept before the client can see it is done
        return [named(e) for e in events]

    def failed(self, error: APIError) -> list[SSE]:
        events, body = self.stream.fail(error)
        _keep(self.store, self.planned, body)  # a failed response is kept, as OpenAI keeps it
        return [named(e) for e in events]

    def broken(self) -> list[SSE]:
        events, _ = self.stream.fail(GenerationFailed("internal server error", code="server_error"))
        return [named(e) for e in events]

    def close(self) -> None:  # kept, failed, or the client hung up: it is no longer running
        self.store.end(self.planned.tenant, self.planned.shape.response_id)


def _begin(store: ResponseStore, planned: Planned) -> None:
    """The response exists from its first event: GET reads it `in_progress`, DELETE forgets it
    for good (`ResponseStore.begin`)."""
    if planned.req.store is not False:
        store.begin(planned.tenant, planned.shape.response_id, planned.shape.body("in_progress", [], None),
                    planned.items)


def _keep(store: ResponseStore, planned: Planned, body: dict[str, Any]) -> None:
    """Store the finished `body` (before the client sees it end); one the store cannot take (its
    answer made the conversation larger than a key's budget) says `"store": false`, so the client
    is never told that a response it cannot continue or read back was kept."""
    if planned.req.store is False:
        return
    turn = Turn(planned.shape.response_id, (*planned.turn, assistant_turn(body["output"])), planned.parent)
    if not store.put(planned.tenant, StoredResponse(turn, body, planned.items)):
        body["store"] = False

