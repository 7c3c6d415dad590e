"""The HTTP layer: FastAPI routes, the OpenAI error envelope, and the app's lifespan (background
model load, engine start/stop). Everything the app owns is one `GatewayState` (gateway/api/state.py)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from gateway.api import cache_routes, dashboard
from gateway.api import completions as completions_api
from gateway.api import messages as messages_api
from gateway.api.dashboard import TtftWindows
from gateway.api.generation import (
    Arrival,
    ChunkWire,
    Release,
    check_model,
    parse_model,
    prepare,
    serve_generation,
    stream_answer,
    whole_json,
)
from gateway.api.responses import routes as responses_api
from gateway.api.responses.store import ResponseStore
from gateway.api.state import GatewayState, ModelSlot, gateway_state
from gateway.api.threads import ThreadStore
from gateway.edge.admission import KeyRing, Preparer, TenantQuota
from gateway.edge.handlers import MessagesRequestId, install_browser_guard, install_error_handlers
from gateway.edge.limits import BodySizeLimit
from gateway.edge.server import CutOffAnswer
from gateway.metrics import Metrics
from gateway.protocol import chat_output
from gateway.protocol.chat import ChatCompletionRequest
from gateway.protocol.completions import CompletionRequest
from gateway.protocol.responses import ResponsesRequest
from gateway.serving.answers import Prepared
from gateway.serving.runtime import Runtime, build_runtime
from gateway.settings import Settings

log = logging.getLogger(__name__)

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
        loader = threading.Thread(target=_load, args=(state, runtime_factory), name="toolkv-loader", daemon=True)
        loader.start()
        yield
        runtime = state.model.runtime
        if runtime is not None:
            runtime.engine.stop()
        state.preparer.close()

    # No /docs or /redoc: FastAPI's pages load their scripts from a CDN (openapi.json stays).
    app = FastAPI(title="toolkv", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    state = app.state.gateway = new_state(settings)
    if state.keyring.open:
        log.warning("no API keys configured: the gateway is open to anyone who can reach %s", settings.host)
    app.add_middleware(BodySizeLimit, limit_bytes=settings.max_request_bytes,
                       read_timeout_s=settings.body_read_timeout_s, keyring=state.keyring)
    install_browser_guard(app, settings)  # refuses foreign Hosts and non-JSON bodies first
    app.add_middleware(CutOffAnswer)  # a request shutdown cuts off gets a JSON 503
    app.add_middleware(MessagesRequestId)  # outermost: `request-id` on every Messages answer
    install_error_handlers(app, state.metrics.requests)
    _install_routes(app)
    app.include_router(cache_routes.router)
    responses_api.install(app, state)
    app.include_router(completions_api.router)
    messages_api.install(app, state)
    app.include_router(dashboard.router)
    app.openapi = lambda: _openapi_with_bodies(app)  # type: ignore[method-assign]
    return app


def new_state(settings: Settings) -> GatewayState:
    """What the app owns, before its model has loaded."""
    return GatewayState(
        settings=settings, metrics=Metrics(), keyring=KeyRing(settings),
        quota=TenantQuota(settings.max_requests_per_key), preparer=Preparer(max_pending=settings.max_queue),
        model=ModelSlot(), ttft_windows=TtftWindows(), started_at=int(time.time()),
        responses=ResponseStore(settings.max_stored_responses, settings.max_stored_response_bytes,
                                settings.max_stored_response_bytes_total),
        threads=ThreadStore(settings.max_stored_responses, settings.max_stored_response_bytes,
                            settings.max_stored_response_bytes_total))


def _load(state: GatewayState, runtime_factory: RuntimeFactory) -> None:
    metrics = state.metrics
    metrics.model_loaded.set(0)
    try:
        state.model.runtime = runtime_factory(state.settings, metrics)
        metrics.model_loaded.set(1)
    except Exception as exc:  # reported by /health and as 503 on requests
        log.exception("model load failed")
        state.model.load_error = str(exc)
        metrics.model_loaded.set(-1)


def end_generations(app: FastAPI) -> None:
    """At the end of the shutdown grace period, end the generations still running."""
    runtime = gateway_state(app).model.runtime
    if runtime is not None:
        runtime.engine.cut_off("the server shut down before this request finished (its shutdown grace period "
                               "ran out); retry it")


def current_runtime(request: Request) -> Runtime:
    return gateway_state(request.app).model.loaded()


def _install_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        model = gateway_state(request.app).model
        status = model.status
        body: dict[str, Any] = {"status": status}
        if model.load_error:
            body["error"] = model.load_error
        return JSONResponse(body, status_code=200 if status != "failed" else 503)

    @app.get("/version")  # as vLLM's; tenant_salt: a trusted proxy's X-Toolkv-Tenant is honoured
    async def version(request: Request) -> JSONResponse:  # (gateway/edge/admission.py), which proxies check
        body: dict[str, Any] = {"version": request.app.version, "tenant_salt": True}
        runtime = gateway_state(request.app).model.runtime
        if runtime is not None:  # once loaded: device, dtype, attention backend (the bench reports them)
            body["engine"] = runtime.engine_info()
        return JSONResponse(body)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        state = gateway_state(request.app)
        state.keyring.tenant(request)
        return JSONResponse(chat_output.model_list(state.model.loaded().model_name, state.started_at))

    @app.get("/v1/models/{model_id:path}")  # a path: hub ids hold a slash ("HuggingFaceTB/SmolLM2-...")
    async def model(request: Request, model_id: str) -> JSONResponse:
        state = gateway_state(request.app)
        state.keyring.tenant(request)
        runtime = state.model.loaded()
        check_model(runtime, model_id or "?")
        return JSONResponse(chat_output.model_list(runtime.model_name, state.started_at)["data"][0])

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state = gateway_state(request.app)
        if state.model.runtime is not None:
            await state.model.runtime.refresh_gauges_off_loop()
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        async def respond(planned: tuple[ChatCompletionRequest, Prepared], release: Release) -> Response:
            req, prepared = planned
            runtime = current_runtime(request)
            if not req.stream:
                return await whole_json(request, runtime, prepared, _whole(runtime, prepared))
            return await _streamed(request, runtime, prepared, req.include_usage, release)

        return await serve_generation(request, chat_output.new_completion_id(), _prepare, respond)


async def _whole(runtime: Runtime, prepared: Prepared) -> dict[str, Any]:
    answer = await runtime.service.complete(prepared)
    return chat_output.completion_dict(prepared.request_id, prepared.model_name, answer,
                                       runtime.service.system_fingerprint, prepared.legacy_functions)


async def _streamed(request: Request, runtime: Runtime, prepared: Prepared, include_usage: bool,
                    release: Release) -> Response:
    chat = chat_output.ChatChunks(prepared.request_id, prepared.model_name, runtime.service.system_fingerprint,
                                  include_usage=include_usage, legacy_functions=prepared.legacy_functions)
    return await stream_answer(request, prepared, runtime.service.stream(prepared), ChunkWire(chat.of), release)


def _prepare(arrival: Arrival) -> tuple[ChatCompletionRequest, Prepared]:
    """Everything between the body and the engine job; runs on a prepare worker thread."""
    req = parse_model(arrival.body, ChatCompletionRequest)
    return req, prepare(arrival, req.to_generation())


def _openapi_with_bodies(app: FastAPI) -> dict[str, Any]:
    """The generation routes parse their own bodies (to word errors as OpenAI does), so their
    schemas are added here."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in _REQUEST_BODIES.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    app.openapi_schema = schema
    return schema


_REQUEST_BODIES: dict[str, type[BaseModel]] = {"/v1/chat/completions": ChatCompletionRequest,
                                               "/v1/responses": ResponsesRequest,
                                               "/v1/completions": CompletionRequest}
