"""The ingress's view of the whole fleet, for operators, installed on proxy mode's app:
`GET /metrics` carries every replica's series with a `replica` label plus the ingress's own
(`fleet_metrics.py`); `GET /health` reports each replica by name; the cache endpoints work across
the replicas (`fleet_cache.py`); and `GET /` is the dashboard over the fleet (`fleet_dashboard.py`)."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway.api import dashboard
from gateway.proxy.cache_pins import PIN_PATH
from gateway.serve_ray import fleet_cache, fleet_dashboard
from gateway.serve_ray.fleet_calls import fleet_status, replica_health
from gateway.serve_ray.fleet_metrics import fleet_collector

# proxy mode's, which know upstreams, not replicas (the pin routes: answers naming replicas)
REPLACED_PATHS = frozenset({"/metrics", "/health", PIN_PATH})


def install_fleet_view(app: FastAPI, replicas: Sequence[str]) -> None:
    """Add the fleet's routes to the proxy app; `replicas` are the upstream base URLs
    (`http://engine-0`, ...)."""
    app.state.replica_urls = tuple(replicas)
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in REPLACED_PATHS]
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.include_router(fleet_cache.router)
    app.include_router(dashboard.page_router)
    app.include_router(fleet_dashboard.router)


async def metrics(request: Request) -> Response:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(await fleet_collector(request))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def health(request: Request) -> JSONResponse:
    """`ok` when every replica serves, `degraded` when some do (200 both), `failed` when none does (503)."""
    replicas = await replica_health(request)
    status = fleet_status(replicas)
    return JSONResponse({"status": status, "mode": "replicas", "replicas": replicas},
                        status_code=503 if status == "failed" else 200)
