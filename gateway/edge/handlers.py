"""The HTTP pieces every toolkv app shares, the model's and the proxy's: the exception handlers
that render the OpenAI error envelope (Anthropic's on the Messages API's paths, each answer there
with its `request-id`), reading a JSON body, and noticing a client that hangs up. Nothing here
imports the engine (proxy mode runs without torch).

The `request-id` header: Anthropic's SDKs read it as a response's `request_id` / `_request_id`,
and a user quotes it when something went wrong. Its value is the id toolkv logs the request
under: the message's id (`msg_…`) once the route took the request (gateway/api/messages.py sets
it on the request's state), or a fresh `req_…` for an answer given before that (a wrong key, a
body too large, a shutdown cut-off: every layer inside `MessagesRequestId`, the outermost)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar, cast

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import Counter
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.edge.admission import disconnected
from gateway.edge.limits import check_json_depth, is_messages_path
from gateway.errors import APIError, BadRequest, error_envelope
from gateway.protocol.fields import InvalidValue, UnsupportedField
from gateway.protocol.messages import error_body as anthropic_error

log = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that hung up before the response
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/responses", "/v1/completions", "/v1/messages"})
GONE: Any = object()  # the client hung up
T = TypeVar("T")


def install_error_handlers(app: FastAPI, requests: Counter) -> None:
    """Every error as the envelope; on generation routes each is counted in `requests` (the app's
    `toolkv_requests_total`, labels `status`, `stream`)."""
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if request.url.path in GENERATION_PATHS:
            requests.labels(status=str(exc.status_code), stream="unknown").inc()
        if exc.status_code >= 500:
            log.warning("request failed: %s", exc.message, extra={"toolkv": {
                "request_id": _request_id(request), "status": exc.status_code}})
        return _rendered(request, exc.envelope(), exc.status_code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(list(exc.errors()))
        return _rendered(request, err.envelope(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        body = error_envelope(str(exc.detail), "invalid_request_error", None, code)
        return _rendered(request, body, exc.status_code, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        """A bug: counted (`toolkv_requests_total{status="500"}` on generation routes), logged with the request
        id and the traceback, answered with a generic envelope (no internals reach the client)."""
        if request.url.path in GENERATION_PATHS:
            requests.labels(status="500", stream="unknown").inc()
        log.error("unhandled error", exc_info=exc, extra={"toolkv": {"request_id": _request_id(request),
                                                                      "status": 500}})
        return _rendered(request, error_envelope("internal server error", "server_error"), 500)


def _rendered(request: Request, envelope: dict[str, Any], status: int,
              headers: dict[str, str] | None = None) -> JSONResponse:
    """The error as OpenAI's envelope, or on the Messages API's paths as Anthropic's."""
    if is_messages_path(request.url.path):
        error = envelope["error"]
        envelope = anthropic_error(error["message"], status, error["param"], error.get("code"))
    return JSONResponse(envelope, status_code=status, headers=headers)


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or `GONE` (with `work` cancelled: its cleanup marks the engine job
    cancelled, so the engine drops it from the queue or stops generating) if the client leaves."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return cast(T, GONE)


# ---- request bodies ----------------------------------------------------------------------


def parse_object(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    check_json_depth(data)
    return data


def validation_error(errors: list[Any]) -> BadRequest:
    first = errors[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, UnsupportedField):
        return BadRequest(str(cause), param=cause.field, code="unsupported_parameter")
    if isinstance(cause, InvalidValue):
        return BadRequest(str(cause), param=cause.field)
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = param_path(loc)
    return BadRequest(f"invalid value for '{param or 'body'}': {first.get('msg')}", param=param or None)


def param_path(loc: list[str]) -> str:
    """The field path of a pydantic error location, without the union-member tags pydantic adds
    (`str`, `list[TextPart]`, `NamedToolChoice`, `function-after[...]`, `literal[...]`)."""
    out = ""
    for part in loc:
        if part.isdigit():
            out += f"[{part}]"
        elif part in ("str", "int", "float", "bool") or part[:1].isupper() or "[" in part:
            continue
        else:
            out += ("." if out else "") + part
    return out


REQUEST_ID_HEADER = "request-id"


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


class MessagesRequestId:
    """Adds `request-id` to the response of every Messages API request, errors included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})  # the dict `request.state` reads and writes
        state.setdefault("request_id", new_request_id())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = str(state["request_id"])
            await send(message)

        await self.app(scope, receive, send_with_id)
