"""The HTTP layer: FastAPI routes, the OpenAI error envelope, and the app's lifespan (background
model load, engine start/stop). Everything the app owns hangs on `app.state`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar, cast

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest
from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import cache_routes, dashboard, protocol
from gateway.admission import Preparer, TenantQuota, disconnected
from gateway.auth import KeyRing, Tenant
from gateway.browser_guard import install_browser_guard
from gateway.errors import APIError, BadRequest, ModelNotFound
from gateway.limits import BodySizeLimit, check_json_depth, check_request_limits
from gateway.metrics import Metrics
from gateway.protocol import ChatCompletionRequest, UnsupportedField
from gateway.runtime import Runtime, build_runtime, loaded_runtime
from gateway.serving import Prepared
from gateway.settings import Settings

log = logging.getLogger(__name__)

BYPASS_HEADER = "x-toolkv-cache"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that hung up before the response
GIL_SWITCH_INTERVAL_S = 0.001
T = TypeVar("T")
RuntimeFactory = Callable[[Settings, Metrics], Runtime]


def create_app(settings: Settings, runtime_factory: RuntimeFactory = build_runtime) -> FastAPI:
    """The app; `runtime_factory` loads the model (in a background thread, so /health answers at once)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The engine thread runs the model's Python between torch ops and takes the GIL back
        # before the event loop wakes, so the loop waits out the whole switch interval (5 ms by
        # default) for every chunk it sends; 1 ms bounds that wait (measured by `toolkv bench`).
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        loader = threading.Thread(target=_load, args=(app, runtime_factory), name="toolkv-loader", daemon=True)
        loader.start()
        yield
        runtime: Runtime | None = app.state.runtime
        if runtime is not None:
            runtime.engine.stop()
        app.state.preparer.close()

    # No /docs or /redoc: FastAPI's pages load their scripts from a CDN (openapi.json stays).
    app = FastAPI(title="toolkv", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.metrics = Metrics()
    app.state.runtime = None
    app.state.load_error = None
    app.state.started_at = int(time.time())
    app.state.keyring = KeyRing(settings)
    app.state.quota = TenantQuota(settings.max_requests_per_key)
    app.state.preparer = Preparer(max_pending=settings.max_queue)
    if app.state.keyring.open:
        log.warning("no API keys configured: the gateway is open to anyone who can reach %s", settings.host)
    app.add_middleware(BodySizeLimit, limit_bytes=settings.max_request_bytes,
                       read_timeout_s=settings.body_read_timeout_s, keyring=app.state.keyring)
    install_browser_guard(app, settings)  # outermost: refuses foreign Hosts and non-JSON bodies first
    _install_error_handlers(app)
    _install_routes(app)
    app.include_router(cache_routes.router)
    app.include_router(dashboard.router)
    app.openapi = lambda: _openapi_with_chat_body(app)  # type: ignore[method-assign]
    return app


def _load(app: FastAPI, runtime_factory: RuntimeFactory) -> None:
    metrics: Metrics = app.state.metrics
    metrics.model_loaded.set(0)
    try:
        app.state.runtime = runtime_factory(app.state.settings, metrics)
        metrics.model_loaded.set(1)
    except Exception as exc:  # reported by /health and as 503 on requests
        log.exception("model load failed")
        app.state.load_error = str(exc)
        metrics.model_loaded.set(-1)


def current_runtime(request: Request) -> Runtime:
    return loaded_runtime(request.app.state)


def _install_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        state = request.app.state
        status = "ok" if state.runtime else ("failed" if state.load_error else "loading")
        body: dict[str, Any] = {"status": status}
        if state.load_error:
            body["error"] = state.load_error
        return JSONResponse(body, status_code=200 if status != "failed" else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        request.app.state.keyring.tenant(request)
        runtime = current_runtime(request)
        return JSONResponse(protocol.model_list(runtime.model_name, request.app.state.started_at))

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        runtime = request.app.state.runtime
        if runtime is not None:
            runtime.refresh_gauges()
        return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        received = time.perf_counter()
        state = request.app.state
        request_id = request.state.request_id = protocol.new_completion_id()
        tenant = state.keyring.tenant(request)
        runtime = current_runtime(request)
        body = await request.body()  # already bounded by BodySizeLimit, after the key was checked
        bypass = request.headers.get(BYPASS_HEADER, "").lower() == "bypass"
        release = state.quota.acquire(tenant.salt) if not state.keyring.open else _nothing
        handed_off = False  # a started stream gives its quota slot back when it ends
        try:
            req, prepared = await state.preparer.run(lambda: _prepare(
                body, runtime, state, tenant, bypass=bypass, received=received, request_id=request_id))
            if not req.stream:
                return await _whole(request, runtime, prepared)
            response = await _streamed(request, runtime, prepared, req.include_usage, release)
            handed_off = isinstance(response, EventSourceResponse)
            return response
        finally:
            if not handed_off:
                release()


async def _whole(request: Request, runtime: Runtime, prepared: Prepared) -> Response:
    with request.app.state.metrics.in_flight.track_inprogress():
        body = await _unless_disconnected(request, runtime.service.complete(prepared))
    if body is _GONE:
        runtime.service.record_disconnect(prepared, stream=False)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(body, headers=prepared.response_headers())


async def _streamed(request: Request, runtime: Runtime, prepared: Prepared, include_usage: bool,
                    release: Callable[[], None]) -> Response:
    state = request.app.state
    chunks = runtime.service.stream(prepared, include_usage)
    # Errors before the first byte become plain HTTP errors; a client that leaves while its
    # stream is still queued cancels it too (the stream records its own 499).
    first = await _unless_disconnected(request, anext(chunks))
    if first is _GONE:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    events = _sse(first, chunks, state.metrics, prepared.request_id)
    return EventSourceResponse(_tracked(state.metrics.in_flight, events, release), sep="\n", ping=15,
                               headers=prepared.response_headers(),
                               shutdown_grace_period=state.settings.shutdown_grace_s)


def _nothing() -> None:
    return None


def _prepare(body: bytes, runtime: Runtime, state: Any, tenant: Tenant, *, bypass: bool,
             received: float, request_id: str) -> tuple[ChatCompletionRequest, Prepared]:
    """Everything between the body and the engine job; runs on a prepare worker thread. Every
    check here is cheap and bounded, and comes before the expensive render and tokenize."""
    req = _parse_chat_request(body)
    settings: Settings = state.settings
    check_request_limits(req, settings)
    if req.model and req.model not in runtime.model_aliases:
        raise ModelNotFound(f"model '{req.model}' does not exist; this server serves "
                            f"'{runtime.model_name}'", param="model")
    keyring: KeyRing = state.keyring
    prepared = runtime.service.prepare(req, bypass=bypass, received=received, request_id=request_id,
                                       salt_for=lambda group_id: keyring.salt_for(tenant, group_id),
                                       tenant=tenant.salt)
    return req, prepared


_GONE: Any = object()  # the client hung up


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or `_GONE` (with `work` cancelled: its cleanup marks the engine job
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
    return cast(T, _GONE)


def _parse_chat_request(body: bytes) -> ChatCompletionRequest:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    check_json_depth(data)
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc.errors()) from None


async def _tracked(gauge: Gauge, events: AsyncIterator[dict[str, str]],
                   release: Callable[[], None]) -> AsyncIterator[dict[str, str]]:
    try:
        with gauge.track_inprogress():
            async for event in events:
                yield event
    finally:
        release()


async def _sse(first: dict[str, Any], chunks: AsyncIterator[dict[str, Any]], metrics: Metrics,
               request_id: str) -> AsyncIterator[dict[str, str]]:
    yield {"data": orjson.dumps(first).decode()}
    try:
        async for chunk in chunks:
            yield {"data": orjson.dumps(chunk).decode()}
    except APIError as exc:
        yield {"data": orjson.dumps(exc.envelope()).decode()}
    except Exception:  # a bug after the first byte: end the stream with an error, count it
        log.exception("unhandled error in a stream", extra={"toolkv": {"request_id": request_id}})
        metrics.requests.labels(status="500", stream="true").inc()
        yield {"data": orjson.dumps(protocol_error("internal server error", "server_error", None)).decode()}
    yield {"data": "[DONE]"}


def _validation_error(errors: list[Any]) -> BadRequest:
    first = errors[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, UnsupportedField):
        return BadRequest(str(cause), param=cause.field, code="unsupported_parameter")
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = _param_path(loc)
    return BadRequest(f"invalid value for '{param or 'body'}': {first.get('msg')}", param=param or None)


def _param_path(loc: list[str]) -> str:
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


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if request.url.path == "/v1/chat/completions":
            request.app.state.metrics.requests.labels(status=str(exc.status_code), stream="unknown").inc()
        if exc.status_code >= 500:
            log.warning("request failed: %s", exc.message, extra={"toolkv": {
                "request_id": _request_id(request), "status": exc.status_code}})
        return JSONResponse(exc.envelope(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = _validation_error(list(exc.errors()))
        return JSONResponse(err.envelope(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        body = protocol_error(str(exc.detail), "invalid_request_error", code)
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        """A bug: counted (`toolkv_requests_total{status="500"}` for chat), logged with the request
        id and the traceback, answered with a generic envelope (no internals reach the client)."""
        if request.url.path == "/v1/chat/completions":
            request.app.state.metrics.requests.labels(status="500", stream="unknown").inc()
        log.error("unhandled error", exc_info=exc, extra={"toolkv": {"request_id": _request_id(request),
                                                                      "status": 500}})
        return JSONResponse(protocol_error("internal server error", "server_error", None), status_code=500)


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


def protocol_error(message: str, error_type: str, code: str | None) -> dict[str, Any]:
    from gateway.errors import error_envelope

    return error_envelope(message, error_type, None, code)



def _openapi_with_chat_body(app: FastAPI) -> dict[str, Any]:
    """The chat route parses its own body (to word errors as OpenAI does), so its schema is added here."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    body = ChatCompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(body.pop("$defs", {}))
    components["ChatCompletionRequest"] = body
    schema["paths"]["/v1/chat/completions"]["post"]["requestBody"] = {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}},
    }
    app.openapi_schema = schema
    return schema
