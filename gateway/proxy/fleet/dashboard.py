"""The dashboard over the fleet: the single gateway's page and numbers (`gateway/api/dashboard.py`,
handed in as `Dashboard` where the app is built: the proxy never imports the model app; the same
files, the same browser guard and CSP). `GET /v1/dashboard/stats` computes the numbers with the
single gateway's functions from the fleet's merged series (every server's, labelled `replica`:
the page's word, and what its TTFT windows follow per series), and adds a row per server: its name,
status, requests in flight, hits and misses, entries. Requests are counted as the proxy answered
them (a retry on a second server is one request); the tool groups are the servers' RAM entries,
and the pinned groups each server's pins, each with its server (bytes and budget as `GET
/v1/cache` counts the fleet's). `mode` is the view's (`proxy`, `replicas`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client.metrics_core import Metric

from gateway.metrics import EngineView
from gateway.proxy import upstream_info
from gateway.proxy.fan_out import UpstreamAnswer
from gateway.proxy.fleet.metrics import fleet_families, only_member
from gateway.proxy.fleet.view import FleetView, ask_members, fleet_pinned, fleet_status, view_of
from gateway.proxy.state import proxy_state

PAGE_LABEL = "replica"  # what the page calls a server, in its rows and in the series it reads


class Collectable(Protocol):
    def collect(self) -> Iterable[Metric]: ...


class TtftWindows(Protocol):
    window_s: float

    def sample(self, source: Collectable, now_s: float) -> None: ...

    def to_json(self) -> list[dict[str, Any]]: ...


class Dashboard(Protocol):
    """What the fleet's dashboard takes from the single gateway's: the module
    `gateway.api.dashboard` itself."""

    @property
    def MAX_GROUP_ROWS(self) -> int: ...  # the module's constant

    @property
    def page_router(self) -> APIRouter: ...

    def totals(self, families: Sequence[Metric]) -> dict[str, Any]: ...

    def request_totals(self, families: Sequence[Metric], sample_name: str) -> dict[str, float]: ...

    def engine(self, families: Sequence[Metric], view: EngineView) -> dict[str, Any]: ...

    def new_ttft_windows(self) -> TtftWindows: ...

    def ttft_ceiling_ms(self, windows: Sequence[dict[str, Any]]) -> float | None: ...


@dataclass(frozen=True, slots=True)
class Collected:
    """Families already collected, as the TTFT windows read them."""

    families: Sequence[Metric]

    def collect(self) -> Iterable[Metric]:
        return self.families


async def fleet_stats(request: Request) -> JSONResponse:
    state = proxy_state(request.app)
    state.keyring.admin(request)  # tool names of every tenant, as on a single gateway
    view = view_of(request)
    page = view.dashboard
    assert page is not None, "the route is added only with a dashboard"
    probes, scraped, stats = await asyncio.gather(
        upstream_info.probe_all(state), ask_members(request, "GET", "/metrics"),
        ask_members(request, "GET", "/v1/dashboard/stats"))
    families = await fleet_families(request, scraped, PAGE_LABEL)
    own = _own_stats(view, stats)
    windows = state.ttft_windows
    assert windows is not None, "made with the dashboard"
    windows.sample(Collected(families), time.time())
    rows = [{"name": (name := view.name(p["url"])), "status": p["status"], "in_flight": p["in_flight"],
             **page.totals(only_member(families, PAGE_LABEL, name))} for p in probes]
    return JSONResponse({
        "status": fleet_status(rows), "mode": view.mode, "model": _model_name(families),
        "totals": _fleet_totals(page, view, families, rows),
        "engine": _fleet_engine(page, families, state.settings.kv_block_tokens) if any(a.ok for a in scraped)
        else None,
        "ttft_windows": (points := windows.to_json()), "ttft_ceiling_ms": page.ttft_ceiling_ms(points),
        "window_s": windows.window_s, "groups": _groups(page, own), "pins": _pins(page, view, own),
        "replicas": rows})


def _fleet_totals(page: Dashboard, view: FleetView, families: Sequence[Metric],
                  rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Summed over the servers, but requests as the proxy answered them, and a shared cache dir's
    disk tier once (every server on it reports the same files)."""
    requests = view.own_prefix + "requests_total"
    fleet = {**page.totals(families), **page.request_totals(families, requests)}
    if view.shared_cache:
        for key in ("cache_entries", "cache_bytes"):
            if any("disk" in row[key] for row in rows):
                fleet[key]["disk"] = max(row[key].get("disk", 0.0) for row in rows)
    return fleet


def _fleet_engine(page: Dashboard, families: Sequence[Metric], block_tokens: int) -> dict[str, Any]:
    """The engines' series summed; the pool is every server's (the last step is no one's)."""
    summed = page.engine(families, EngineView(kv_block_tokens=block_tokens))
    blocks = summed["kv_blocks"]
    blocks["total"] = blocks["used"] + blocks["free"]
    return summed


def _own_stats(view: FleetView, stats: list[UpstreamAnswer]) -> dict[str, dict[str, Any]]:
    """Each server's own `/v1/dashboard/stats`, by name (those that answered with one)."""
    return {view.name(answer.url): own for answer in stats if (own := answer.json_object()) is not None}


def _groups(page: Dashboard, own: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every server's RAM groups (its own cheap listing), most recently used first."""
    rows = [{**group, PAGE_LABEL: name} for name, stats in own.items() for group in stats.get("groups") or ()]
    return sorted(rows, key=lambda row: row["last_used_at"], reverse=True)[:page.MAX_GROUP_ROWS]


def _pins(page: Dashboard, view: FleetView, own: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Every server's pinned groups (a group pinned in a shared cache dir is listed by each), largest
    first; None until a server has loaded its model."""
    pins = {name: stats["pins"] for name, stats in own.items() if stats.get("pins")}
    if not pins:
        return None
    groups = [{**group, PAGE_LABEL: name} for name, server in pins.items() for group in server["groups"]]
    return {**fleet_pinned(list(pins.values()), view.shared_cache),
            "groups": sorted(groups, key=lambda group: group["num_bytes"], reverse=True)[:page.MAX_GROUP_ROWS]}


def _model_name(families: Sequence[Metric]) -> str | None:
    """The served model, as the engines' vLLM-named series label it."""
    return next((s.labels["model_name"] for f in families for s in f.samples if "model_name" in s.labels), None)
