"""The HTTP layer: FastAPI routes, the OpenAI error envelope, and the app's lifespan (background
model load, engine start/stop). Everything the app owns hangs on `app.state`."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest
from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import cache_routes, dashboard, protocol
from gateway.auth import KeyRing
from gateway.errors import APIError, BadRequest, ModelNotFound
from gateway.limits import BodySizeLimit, check_request_limits
from gateway.metrics import Metrics
from gateway.protocol import ChatCompletionRequest
from gateway.runtime import Runtime, build_runtime, loaded_runtime
from gateway.settings import Settings

log = logging.getLogger(__name__)

BYPASS_HEADER = "x-toolkv-cache"
GIL_SWITCH_INTERVAL_S = 0.001
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

    app = FastAPI(title="toolkv", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = Metrics()
    app.state.runtime = None
    app.state.load_error = None
    app.state.started_at = int(time.time())
    app.state.keyring = KeyRing(settings)
    if app.state.keyring.open:
        log.warning("no API keys configured: the gateway is open to anyone who can reach %s", settings.host)
    app.add_middleware(BodySizeLimit, limit_bytes=settings.max_request_bytes)
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
        tenant = request.app.state.keyring.tenant(request)
        req = await _parse_chat_request(request)
        check_request_limits(req, request.app.state.settings)
        runtime = current_runtime(request)
        if req.model and req.model not in runtime.model_aliases:
            raise ModelNotFound(f"model '{req.model}' does not exist; this server serves "
                                f"'{runtime.model_name}'", param="model")
        bypass = request.headers.get(BYPASS_HEADER, "").lower() == "bypass"
        prepared = runtime.service.prepare(req, bypass=bypass, received=received)
        prepared.job.salt = request.app.state.keyring.salt_for(tenant, prepared.group_id)
        in_flight = request.app.state.metrics.in_flight
        if not req.stream:
            with in_flight.track_inprogress():
                body = await runtime.service.complete(prepared)
            return JSONResponse(body, headers=prepared.response_headers())
        chunks = runtime.service.stream(prepared, req.include_usage)
        first = await anext(chunks)  # errors before the first byte become plain HTTP errors
        grace_s = request.app.state.settings.shutdown_grace_s  # streams in flight finish on SIGTERM
        return EventSourceResponse(_tracked(in_flight, _sse(first, chunks)), sep="\n", ping=15,
                                   headers=prepared.response_headers(), shutdown_grace_period=grace_s)


async def _parse_chat_request(request: Request) -> ChatCompletionRequest:
    body = await request.body()  # already bounded by BodySizeLimit
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc.errors()) from None


async def _tracked(gauge: Gauge, events: AsyncIterator[dict[str, str]]) -> AsyncIterator[dict[str, str]]:
    with gauge.track_inprogress():
        async for event in events:
            yield event


async def _sse(first: dict[str, Any], chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, str]]:
    yield {"data": orjson.dumps(first).decode()}
    try:
        async for chunk in chunks:
            yield {"data": orjson.dumps(chunk).decode()}
    except APIError as exc:
        yield {"data": orjson.dumps(exc.envelope()).decode()}
    yield {"data": "[DONE]"}


def _validation_error(errors: list[Any]) -> BadRequest:
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = _param_path(loc)
    return BadRequest(f"invalid value for '{param or 'body'}': {first.get('msg')}", param=param or None)


def _param_path(loc: list[str]) -> str:
    out = ""
    for part in loc:
        if part.isdigit():
            out += f"[{part}]"
        elif part in ("str", "list[TextPart]", "NamedToolChoice", "function-after[_content_required(), MessageIn]"):
            continue
        elif not part.startswith(("literal[", "function-", "list[", "str", "int", "float", "bool")):
            out += ("." if out else "") + part
    return out


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if request.url.path == "/v1/chat/completions":
            request.app.state.metrics.requests.labels(status=str(exc.status_code), stream="unknown").inc()
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
        log.exception("unhandled error")
        return JSONResponse(protocol_error("internal server error", "server_error", None), status_code=500)


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
