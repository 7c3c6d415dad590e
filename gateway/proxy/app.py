"""Proxy mode's app (`toolkv serve --upstream URL[,URL...]`): no model; generation requests go to
OpenAI-compatible upstreams picked by tool-group affinity, behind the model app's edge (API keys
and tenants, the per-key quota, body limits, the browser guard, the error envelope). Everything
the app owns is one `ProxyState` (gateway/proxy/state.py). In `upstream_cache_salt = "tenant"` mode with keys, every
request names its tenant to the upstream, and only upstreams known to keep tenants apart get one
(gateway/proxy/tenancy.py): the proxy refuses to start when an upstream cannot. How the upstreams
are shown (`/health`, `/metrics`, the cache across them, the dashboard) is the fleet view the
builder picks (gateway/proxy/fleet/)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.cookiejar
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gateway.edge.admission import KeyRing, Preparer, Tenant, TenantQuota
from gateway.edge.handlers import (
    CLIENT_CLOSED_REQUEST,
    GONE,
    install_browser_guard,
    install_error_handlers,
    parse_object,
    unless_disconnected,
)
from gateway.edge.limits import BodySizeLimit
from gateway.errors import BadGateway, BadRequest, ModelNotFound, NotFound, UpstreamUnavailable
from gateway.proxy import tenancy, upstream_info
from gateway.proxy.bounded import Unreadable, fetch, passed_headers, passed_status
from gateway.proxy.exchange import Exchange
from gateway.proxy.fleet.routes import fleet_routes
from gateway.proxy.fleet.view import FleetView, upstream_view
from gateway.proxy.forward import JSON_HEADERS, Answer, Bounds, Forwarder, Opened, answer_usage, json_object
from gateway.proxy.headers import upstream_headers
from gateway.proxy.metrics import ProxyMetrics
from gateway.proxy.response_homes import ResponseHomes, answer_response_id, stream_response_id
from gateway.proxy.routing import affinity_key, cache_key_affinity, make_router
from gateway.proxy.shaping import PATHS, Forward, Kind, shape
from gateway.proxy.state import ProxyState, proxy_state
from gateway.proxy.streaming import RelayResponse
from gateway.proxy.upstreams import Release, UpstreamPool
from gateway.settings import Settings

log = logging.getLogger(__name__)

RESPONSE_HOMES = 100_000  # Responses ids remembered (each ~200 bytes), least recently used out


def create_proxy_app(settings: Settings, transport: httpx.AsyncBaseTransport | None = None,
                     view: FleetView | None = None) -> FastAPI:
    """The app; `settings.upstreams` must name at least one upstream. `transport` replaces the
    network (Ray Serve mode reaches its engine replicas through deployment handles); `view` is how
    the upstreams are shown (gateway/proxy/fleet/view.py; proxy mode's, without a dashboard, by default)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await tenancy.check_at_start(state)
        except BaseException:
            await state.forwarder.client.aclose()
            state.preparer.close()
            raise
        watch = (asyncio.create_task(upstream_info.watch(state, settings.upstream_probe_s))
                 if settings.upstream_probe_s > 0 else None)
        yield
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        await state.forwarder.client.aclose()
        state.preparer.close()

    app = FastAPI(title="toolkv proxy", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    state = app.state.proxy = _state(settings, transport, view or upstream_view())
    if state.keyring.open:
        log.warning("no API keys configured: the proxy is open to anyone who can reach %s", settings.host)
    app.add_middleware(BodySizeLimit, limit_bytes=settings.max_request_bytes,
                       read_timeout_s=settings.body_read_timeout_s, keyring=state.keyring)
    install_browser_guard(app, settings)  # outermost: refuses foreign Hosts and non-JSON bodies first
    install_error_handlers(app, state.metrics.requests)
    _install_routes(app)
    app.include_router(fleet_routes(state.fleet_view))  # /health, /metrics, /v1/cache, the dashboard
    return app


def _state(settings: Settings, transport: httpx.AsyncBaseTransport | None, view: FleetView) -> ProxyState:
    metrics, keyring = ProxyMetrics(), KeyRing(settings)
    pool = UpstreamPool(settings.upstreams, settings.upstream_down_s, metrics)
    bounds = Bounds(settings.upstream_max_body_bytes, settings.upstream_event_timeout_s)
    return ProxyState(
        settings=settings, metrics=metrics, keyring=keyring, quota=TenantQuota(settings.max_requests_per_key),
        preparer=Preparer(max_pending=settings.max_queue), pool=pool,
        forwarder=Forwarder(upstream_client(settings, transport), pool, bounds),
        router=make_router(settings.upstreams, settings.upstream_routing, settings.upstream_max_in_flight),
        # an upstream keeps max_stored_responses per key: more than all of theirs is never needed
        response_homes=ResponseHomes(RESPONSE_HOMES, settings.max_stored_responses * len(settings.upstreams)),
        tenant_safety=tenancy.TenantSafety(settings.upstreams, tenancy.required(settings, keyring.open)),
        fleet_view=view, ttft_windows=view.dashboard.new_ttft_windows() if view.dashboard is not None else None)


def upstream_client(settings: Settings, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """One connection pool for every upstream; no environment proxies (the upstreams are named);
    every request asks for `identity` (answers are read raw: gateway/proxy/bounded.py). No cookie
    an upstream sets is kept: the client is shared by every tenant, and a kept cookie (a load
    balancer's session, an auth proxy's) would go out on every other client's requests."""
    timeout = httpx.Timeout(settings.upstream_read_timeout_s, connect=settings.upstream_connect_timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    no_cookies = http.cookiejar.CookieJar(policy=http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False, follow_redirects=False,
                             transport=transport, headers={"accept-encoding": "identity"}, cookies=no_cookies)


def _install_routes(app: FastAPI) -> None:
    @app.get("/version")  # as a toolkv's: a proxy in tenant mode passes the tenant a trusted proxy names on
    async def version(request: Request) -> JSONResponse:
        safety: tenancy.TenantSafety = proxy_state(request.app).tenant_safety
        return JSONResponse({"version": request.app.version, "tenant_salt": safety.required})

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        proxy_state(request.app).keyring.tenant(request)
        return JSONResponse(await upstream_info.models(proxy_state(request.app), upstream_headers(request)))

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        proxy_state(request.app).keyring.tenant(request)
        listed = await upstream_info.models(proxy_state(request.app), upstream_headers(request))
        found = next((entry for entry in listed["data"] if entry.get("id") == model_id), None)
        if found is None:
            raise ModelNotFound(f"model '{model_id[:200]}' does not exist on any upstream", param="model")
        return JSONResponse(found)

    for kind, path in PATHS.items():
        app.add_api_route(path, _endpoint(kind), methods=["POST"], name=f"proxy_{kind}")

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(request: Request, response_id: str) -> Response:
        return await _stored(request, response_id, "")

    @app.get("/v1/responses/{response_id}/input_items")
    async def stored_input_items(request: Request, response_id: str) -> Response:
        return await _stored(request, response_id, "/input_items")


async def _stored(request: Request, response_id: str, rest: str) -> Response:
    """A stored Responses answer, asked of the upstream that answered it (known only for this
    tenant's responses relayed since the proxy started: any other id is not found)."""
    state = proxy_state(request.app)
    tenant: Tenant = state.keyring.tenant(request)
    homes: ResponseHomes = state.response_homes
    upstream = homes.home(tenant.salt, response_id)
    if upstream is None:
        raise NotFound(f"Response with id '{response_id[:100]}' not found.", param="response_id")
    client: httpx.AsyncClient = state.forwarder.client
    url = f"{upstream}/v1/responses/{response_id}{rest}"
    settings: Settings = state.settings
    try:
        resp, content = await fetch(client, request.method, url, params=httpx.QueryParams(str(request.query_params)),
                                    headers=upstream_headers(request, tenant), limit=settings.upstream_max_body_bytes,
                                    timeout_s=settings.upstream_connect_timeout_s)  # a lookup, not a generation
    except httpx.HTTPError:
        raise UpstreamUnavailable("the upstream that stored this response is not reachable",
                                  headers={"Retry-After": "1"}) from None
    except Unreadable as exc:
        raise BadGateway(f"the upstream that stored this response answered badly: {exc}") from None
    if not passed_status(resp.status_code):
        raise BadGateway(f"the upstream that stored this response answered {resp.status_code}")
    if json_object(content) is None:  # an HTML error page, say: not an answer of this API
        raise BadGateway(f"the upstream that stored this response answered {resp.status_code} without a JSON object")
    if request.method == "DELETE" and resp.status_code == 200:
        homes.forget(tenant.salt, response_id)
    return Response(content, status_code=resp.status_code, headers=passed_headers(resp.headers, JSON_HEADERS))


def _endpoint(kind: Kind) -> Callable[[Request], Awaitable[Response]]:
    async def generate(request: Request) -> Response:
        return await _generate(request, kind)

    return generate


async def _generate(request: Request, kind: Kind) -> Response:
    """Check the key, hold one of its quota slots, shape the body (on a prepare thread), forward."""
    received = time.perf_counter()
    state = proxy_state(request.app)
    request_uuid = uuid.uuid4()
    request.state.request_id = f"proxy-{request_uuid.hex}"
    request.state.upstream_request_id = str(request_uuid)  # the same digits, as a UUID (see upstream_headers)
    tenant: Tenant = state.keyring.tenant(request)
    body = await request.body()  # already bounded by BodySizeLimit, after the key was checked
    release = _hold(request, tenant)
    handed_off = False
    try:
        salt_for = functools.partial(state.keyring.salt_for, tenant)
        fwd = await state.preparer.run(lambda: shape(kind, parse_object(body), state.settings, salt_for),
                                       tenant=tenant.salt)
        response = await _forward(request, fwd, received, release, tenant)
        handed_off = isinstance(response, RelayResponse)
        return response
    finally:
        if not handed_off:
            release()


async def _forward(request: Request, fwd: Forward, received: float, release: Release, tenant: Tenant) -> Response:
    state = proxy_state(request.app)
    homes: ResponseHomes = state.response_homes
    exchange = Exchange(state.metrics, request.state.request_id, fwd.group_id, fwd.stream, received)
    key = cache_key_affinity(tenant.salt, fwd.cache_key) if fwd.cache_key else affinity_key(fwd.salt, fwd.group_id)
    route = state.router.route(key, state.pool.in_flight(), state.pool.down())
    safety: tenancy.TenantSafety = state.tenant_safety
    if fwd.previous_response_id is not None:
        stored = homes.home(tenant.salt, fwd.previous_response_id)
        if stored is None and not state.keyring.open:  # upstreams do not tell this key's responses from another's
            raise BadRequest(f"Previous response with id '{fwd.previous_response_id[:100]}' not found.",
                             param="previous_response_id", code="previous_response_not_found")
        if stored is not None and stored not in state.pool.down():  # else: it answers for itself, elsewhere
            route = route.first(stored)
    route = safety.restrict(route)  # tenant mode: only upstreams known to keep tenants apart
    held = state.pool.acquire(route.order[0])  # at once: the next request routed counts this one
    forwarder: Forwarder = state.forwarder
    opened: Opened | None = None
    try:
        work = forwarder.open(fwd, route, upstream_headers(request, tenant), exchange, held)
        result = await unless_disconnected(request, work)
        opened = result if isinstance(result, Opened) else None
    finally:
        if opened is None or opened.release is not held:  # else the relay gives it back
            held()
    if result is GONE:
        exchange.finish(CLIENT_CLOSED_REQUEST)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if isinstance(result, Answer):
        if safety.required and result.status == 403 and b'"tenant_not_trusted"' in result.content:
            # restarted without this proxy's key in trusted_proxy_keys: no more requests until it has it again
            safety.note(result.upstream, tenancy.Check("refused", "it answered tenant_not_trusted"))
            exchange.finish(502)
            raise BadGateway("an upstream no longer takes this proxy's tenants; it gets no requests until it does")
        if result.status == 200:
            exchange.usage = answer_usage(fwd.kind, result)
            if fwd.kind == "responses" and (response_id := answer_response_id(result.content)):
                homes.remember(tenant.salt, response_id, result.upstream)
        exchange.finish(result.status)
        return Response(result.content, status_code=result.status, headers=result.headers)
    assert opened is not None
    if fwd.kind == "responses" and (response_id := stream_response_id(opened.first)):
        homes.remember(tenant.salt, response_id, opened.upstream)
    return RelayResponse(forwarder.relay(opened, fwd, exchange, release), headers=opened.headers)


def _hold(request: Request, tenant: Tenant) -> Release:
    """Count the request in flight and take one of its key's quota slots; the returned callable
    gives both back (once)."""
    state = proxy_state(request.app)
    quota_release = state.quota.acquire(tenant.salt) if not state.keyring.open else None
    state.metrics.in_flight.inc()
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            state.metrics.in_flight.dec()
            if quota_release is not None:
                quota_release()

    return release
