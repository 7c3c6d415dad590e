"""`POST /v1/messages`: Anthropic's Messages API, whole and streamed, run as the generation the
equivalent chat request asks for (gateway/protocol/messages.py) through the chat service, so tool
groups, conversation reuse, keys (`x-api-key` or a bearer token), quotas and the cache headers work exactly as for
chat, and a Messages request shares its KV with the equivalent chat request. Errors are in
Anthropic's envelope (gateway/edge/handlers.py renders them for this path); `anthropic-version`
and `anthropic-beta` headers are accepted whatever they say."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

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
from gateway.api.messages_stream import (
    MessageEvents,
    content_of,
    message_body,
    new_message_id,
    stop_reason,
    usage_of,
)
from gateway.api.state import GatewayState, gateway_state
from gateway.api.threads import ThreadTurn, threaded
from gateway.edge.handlers import new_request_id
from gateway.errors import APIError
from gateway.protocol.answer import AnswerEvent
from gateway.protocol.messages import CountTokensRequest, MessagesRequest, to_generation
from gateway.serving.answers import Prepared
from gateway.serving.runtime import Runtime

# Not in /openapi.json, which describes the OpenAI-compatible API (Anthropic publishes this one's).
router = APIRouter(include_in_schema=False)


def install(app: FastAPI, state: GatewayState) -> None:
    """The routes, and the budgets of the store of message threads (`state.threads`, bounded as the
    Responses store is, by `max_stored_responses`, `max_stored_response_bytes` per key and
    `max_stored_response_bytes_total`, its own budget) as gauges."""
    settings = state.settings
    budgets = state.metrics.memory_budget_bytes
    budgets.labels(structure="message_threads").set(settings.max_stored_response_bytes_total)
    budgets.labels(structure="message_threads_per_key").set(settings.max_stored_response_bytes)
    app.include_router(router)


@dataclass(frozen=True, slots=True)
class Planned:
    req: MessagesRequest
    prepared: Prepared
    thread: ThreadTurn | None = None  # a threaded request: keep its reply


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    async def respond(planned: Planned, release: Release) -> Response:
        state = gateway_state(request.app)
        runtime = state.model.loaded()
        if not planned.req.stream:
            return await whole_json(request, runtime, planned.prepared, _whole(state, runtime, planned))
        return await _streamed(request, runtime, planned, release)

    return await serve_generation(request, new_message_id(), _plan, respond)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    """The prompt's tokens, `{"input_tokens": N}`: what `usage` of the same `/v1/messages`
    request adds up to (input + cache reads + cache writes). The request is validated and
    prepared exactly as a message would be (a 400 for what `/v1/messages` refuses), then not run."""
    async def respond(planned: Planned, release: Release) -> Response:
        return JSONResponse({"input_tokens": len(planned.prepared.job.prompt_ids)})

    return await serve_generation(request, new_request_id(), _plan_count, respond)


def _plan(arrival: Arrival) -> Planned:
    """Parse, turn into a generation request and prepare (on a prepare thread)."""
    return _prepared(arrival, parse_model(arrival.body, MessagesRequest))


def _plan_count(arrival: Arrival) -> Planned:
    return _prepared(arrival, parse_model(arrival.body, CountTokensRequest))


def _prepared(arrival: Arrival, req: MessagesRequest) -> Planned:
    req, thread = threaded(req, arrival.state.threads, arrival.tenant.salt)  # a continue: the whole conversation
    return Planned(req, prepare(arrival, to_generation(req)), thread)


def _keep(state: GatewayState, planned: Planned, content: list[dict[str, Any]]) -> None:
    """A threaded request's reply, kept (with the conversation) under its message's id."""
    thread = planned.thread
    if thread is not None:
        state.threads.put(thread.tenant, planned.prepared.request_id, thread.record(content), thread.continues)


async def _whole(state: GatewayState, runtime: Runtime, planned: Planned) -> dict[str, Any]:
    prepared = planned.prepared
    answer = await runtime.service.complete(prepared)  # its errors name Messages fields already
    content = content_of(answer)
    _keep(state, planned, content)
    return message_body(prepared.request_id, prepared.model_name, content,
                        stop_reason(answer.finish_reason, answer.stop_sequence), usage_of(answer.usage),
                        answer.stop_sequence)


async def _streamed(request: Request, runtime: Runtime, planned: Planned, release: Release) -> Response:
    wire = _MessagesWire(planned, gateway_state(request.app))
    return await stream_answer(request, planned.prepared, runtime.service.stream(planned.prepared), wire, release)


class _MessagesWire(WireEvents):
    """The answer's Messages events; a threaded reply is kept once the message is whole (a stream
    that ends early keeps nothing: the SDKs start a new thread then)."""

    def __init__(self, planned: Planned, state: GatewayState) -> None:
        self.planned, self.state = planned, state
        self.stream = MessageEvents(planned.prepared.request_id, planned.prepared.model_name)

    def of(self, event: AnswerEvent) -> list[SSE]:
        events = self.stream.feed(event)
        if self.stream.ended:
            _keep(self.state, self.planned, self.stream.content)
        return [named(event) for event in events]

    def failed(self, error: APIError) -> list[SSE]:
        return [named(event) for event in self.stream.fail(error.message,
                                                           error.status_code)]

    def broken(self) -> list[SSE]:
        return [named(event) for event in self.stream.fail("internal server error", 500)]
