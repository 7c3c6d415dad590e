"""The HTTP pieces every toolkv app shares, the model's and the proxy's: the exception handlers
that render the OpenAI error envelope (Anthropic's on the Messages API's paths, each answer there
with its `request-id`), reading a JSON body, noticing a client that hangs up, and the browser
guard (`BrowserGuard`, a middleware). Nothing here imports the engine (proxy mode runs without
torch).

The `request-id` header: Anthropic's SDKs read it as a response's `request_id` / `_request_id`,
and a user quotes it when something went wrong. Its value is the id toolkv logs the request
under: the message's id (`msg_…`) once the route took the request (gateway/api/messages.py sets
it on the request's state), or a fresh `req_…` for an answer given before that (a wrong key, a
body too large, a shutdown cut-off: every layer inside `MessagesRequestId`, the outermost).

The browser guard: defences against what a web page in the user's browser can make it send to the
gateway.

A page on any site may POST to `http://127.0.0.1:8000` without a CORS preflight as long as the
request is "simple" (a `text/plain` or form body); the gateway parses the body as JSON whatever its
Content-Type, so such a POST would run a chat or warm the cache (CSRF). Requests that change
something must therefore say `Content-Type: application/json`, which a page can only send after a
preflight that the gateway never approves (it sends no CORS headers).

A page can also rebind its own host name to 127.0.0.1 (DNS rebinding): the browser then treats
the gateway as same-origin with the page and lets it read the answers (`/v1/cache` lists tool
names). The browser still sends the page's host name in `Host`, so the open gateway answers only
Host headers naming it: the bound address, loopback names, or `allowed_hosts`.

HTML responses (the dashboard) get a strict Content-Security-Policy and may not be framed.
"""

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
from gateway.edge.limits import check_json_depth, envelope_for, is_messages_path
from gateway.errors import APIError, BadRequest, MisdirectedRequest, UnsupportedMediaType, error_envelope, send_error
from gateway.protocol.fields import InvalidValue, UnsupportedField
from gateway.protocol.messages import error_body as anthropic_error
from gateway.settings import Settings

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


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})  # "listen everywhere": never a Host a client sends
ANY_HOST = "*"
# Infrastructure reads these by service name (Prometheus scrapes `gateway:8000`); they hold only
# counters and a status, nothing a rebinding page could use against a tenant.
HOST_EXEMPT_PATHS = frozenset({"/health", "/metrics"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
JSON_MEDIA_TYPE = "application/json"

# The dashboard loads its script, style and icon from /static and talks to /v1 on the same origin.
DASHBOARD_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
                 "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
                 "frame-ancestors 'none'")
HTML_HEADERS = ((b"content-security-policy", DASHBOARD_CSP.encode()), (b"x-frame-options", b"DENY"),
                (b"referrer-policy", b"no-referrer"))
EVERY_RESPONSE_HEADERS = ((b"x-content-type-options", b"nosniff"),)


class BrowserGuard:
    """Pure ASGI middleware: JSON-only bodies on `/v1/`, the Host check on the open gateway, and
    security headers on the way out."""

    def __init__(self, app: ASGIApp, check_host: bool, allowed_hosts: tuple[str, ...] = (),
                 bound_host: str = "127.0.0.1") -> None:
        self.app = app
        self.check_host = check_host and ANY_HOST not in allowed_hosts
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts)
        self.bound_host = bound_host.lower().strip("[]")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self.refusal(scope)
        if error is not None:
            await send_error(send, error, EVERY_RESPONSE_HEADERS, body=envelope_for(scope["path"], error))
            return
        await self.app(scope, receive, _with_security_headers(send))

    def refusal(self, scope: Scope) -> APIError | None:
        """The error for a request a page could have forged, or None to serve it."""
        headers = _headers(scope)
        if self.check_host and scope["path"] not in HOST_EXEMPT_PATHS:
            host = headers.get(b"host")
            if host is not None and not self.host_allowed(host.decode("latin-1"), scope):
                shown = host.decode("latin-1")[:100]
                return MisdirectedRequest(
                    f"this gateway does not answer for Host '{shown}': add it to the 'allowed_hosts' "
                    "setting (or configure API keys)")
        needs_json = scope["path"].startswith("/v1/") and _needs_json(scope["method"], headers)
        if needs_json and not is_json_media_type(headers.get(b"content-type", b"")):
            return UnsupportedMediaType("the request body must be JSON: send 'Content-Type: application/json'")
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        if needs_json and encoding not in (b"", b"identity"):  # never decoded: it was read as broken text
            shown = encoding.decode("latin-1")[:40]
            return UnsupportedMediaType(f"a request body in content-encoding '{shown}' is not supported: send it "
                                        "uncompressed")
        return None

    def host_allowed(self, host: str, scope: Scope) -> bool:
        """True for the bound address or a loopback name with the server's port, or an allowed host."""
        name, port = split_host(host.lower())
        if host.lower() in self.allowed_hosts or name in self.allowed_hosts:
            return True
        server_name, server_port = scope.get("server") or (None, None)
        local = {self.bound_host, str(server_name or "").lower()} - WILDCARD_BINDS
        return name in LOOPBACK_NAMES | local and (server_port is None or port == server_port)


def install_browser_guard(app: Any, settings: Settings) -> None:
    """Add the guard as the outermost middleware of `app` (before the body is read or parsed).

    With API keys configured the Host header is not checked: a rebinding page cannot read or
    send the key (it lives in the client's code, not in a cookie the browser would attach)."""
    is_open = not settings.api_keys and settings.admin_key is None
    app.add_middleware(BrowserGuard, check_host=is_open, allowed_hosts=settings.allowed_hosts,
                       bound_host=settings.host)


def is_json_media_type(value: bytes) -> bool:
    """`application/json`, with or without parameters (`; charset=utf-8`), in any letter case."""
    media_type = value.decode("latin-1").split(";", 1)[0].strip().lower()
    return media_type == JSON_MEDIA_TYPE


def split_host(host: str) -> tuple[str, int | None]:
    """('name', port) from a Host header: `a.b:8000`, `[::1]:8000`, `localhost` (port 80)."""
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        name, _, port_text = host.partition(":") if host.count(":") == 1 else (host, "", "")
    if not port_text:
        return name, 80
    return (name, int(port_text)) if port_text.isdigit() else (name, None)


def _needs_json(method: str, headers: dict[bytes, bytes]) -> bool:
    """POST, PUT, PATCH always carry a body; DELETE only when it has one (`curl -X DELETE`
    sends none, and a page cannot send a DELETE cross-origin without a preflight anyway)."""
    if method in BODY_METHODS:
        return True
    has_body = headers.get(b"content-length", b"0") not in (b"", b"0") or b"transfer-encoding" in headers
    return method == "DELETE" and has_body


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {name.lower(): value for name, value in scope["headers"]}


def _with_security_headers(send: Send) -> Send:
    async def send_with_headers(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
            extra = EVERY_RESPONSE_HEADERS + (HTML_HEADERS if content_type.startswith(b"text/html") else ())
            present = {k.lower() for k, _ in headers}
            headers += [(k, v) for k, v in extra if k not in present]
            message = {**message, "headers": headers}
        await send(message)

    return send_with_headers
