"""The routes of the fleet view, added when the app is built (`fleet_routes`): `GET /health` reports
each server by name (a probe also marks it up or down for routing); the merged Prometheus series
(`metrics.py`) at the view's path, and the app's own at `/metrics` when the merge is elsewhere; the
cache endpoints across the servers (`cache.py`, pins: `pins.py`); and, with a dashboard handed in,
its page at `/` and `GET /v1/dashboard/stats` over the fleet (`dashboard.py`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway.proxy import upstream_info
from gateway.proxy.fleet import cache, dashboard
from gateway.proxy.fleet.metrics import fleet_collector
from gateway.proxy.fleet.view import FleetView, fleet_status, view_of
from gateway.proxy.state import proxy_state


def fleet_routes(view: FleetView) -> APIRouter:
    router = APIRouter()
    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route(view.metrics_path, merged_metrics, methods=["GET"])
    if view.metrics_path != "/metrics":
        router.add_api_route("/metrics", own_metrics, methods=["GET"])
    router.include_router(cache.router)
    if view.dashboard is not None:
        router.include_router(view.dashboard.page_router)
        router.add_api_route("/v1/dashboard/stats", dashboard.fleet_stats, methods=["GET"], include_in_schema=False)
    return router


async def health(request: Request) -> JSONResponse:
    """`ok` when every server serves, `degraded` when some do (200 both), `failed` when none does (503)."""
    view = view_of(request)
    probes = await upstream_info.probe_all(proxy_state(request.app))
    rows = [{view.name_key: view.name(p["url"]), **{k: v for k, v in p.items() if k != "url"}} for p in probes]
    status = fleet_status(rows)
    return JSONResponse({"status": status, "mode": view.mode, view.members: rows},
                        status_code=503 if status == "failed" else 200)


async def merged_metrics(request: Request) -> Response:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(await fleet_collector(request))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def own_metrics(request: Request) -> Response:
    return Response(generate_latest(proxy_state(request.app).metrics.registry), media_type=CONTENT_TYPE_LATEST)
