"""The dashboard on the Ray ingress: the single gateway's page (`gateway/api/dashboard.py`, the same
files, the same browser guard and CSP) over the whole fleet. `GET /v1/dashboard/stats` computes
the numbers with the single gateway's functions from the fleet's merged series (every replica's,
labelled `replica`), and adds a row per replica: its name, status, requests in flight, hits and
misses, entries. Requests are counted as the ingress answered them (a retry on a second replica
is one request); the tool groups are the replicas' RAM entries, and the pinned groups each
replica's pins, each with its replica (bytes and budget as `GET /v1/cache` counts the fleet's)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client.metrics_core import Metric

from gateway.api.dashboard import MAX_GROUP_ROWS, engine, request_totals, totals, ttft_ceiling_ms, ttft_windows
from gateway.metrics import EngineView
from gateway.serve_ray.fleet_calls import ReplicaAnswer, ask_replicas, fleet_pinned, fleet_status, replica_health
from gateway.serve_ray.fleet_metrics import fleet_families, ingress_name, only_replica

router = APIRouter(include_in_schema=False)


@dataclass(frozen=True, slots=True)
class Collected:
    """Families already collected, as the TTFT windows read them."""

    families: Sequence[Metric]

    def collect(self) -> Iterable[Metric]:
        return self.families


@router.get("/v1/dashboard/stats")
async def fleet_stats(request: Request) -> JSONResponse:
    request.app.state.keyring.admin(request)  # tool names of every tenant, as on a single gateway
    replicas, scraped, stats = await asyncio.gather(
        replica_health(request), ask_replicas(request, "GET", "/metrics"),
        ask_replicas(request, "GET", "/v1/dashboard/stats"))
    families = await fleet_families(request, scraped)
    windows = ttft_windows(request.app)
    windows.sample(Collected(families), time.time())
    rows = [{**replica, **totals(only_replica(families, replica["name"]))} for replica in replicas]
    return JSONResponse({
        "status": fleet_status(replicas), "mode": "replicas", "model": _model_name(families),
        "totals": _fleet_totals(families, rows, request.app.state.settings.replica_cache),
        "engine": _fleet_engine(families, request.app.state.settings.kv_block_tokens)
        if any(a.status == 200 for a in scraped) else None,
        "ttft_windows": (points := windows.to_json()), "ttft_ceiling_ms": ttft_ceiling_ms(points),
        "window_s": windows.window_s, "groups": _groups(stats),
        "pins": _pins(stats, request.app.state.settings.replica_cache), "replicas": rows})


def _fleet_totals(families: Sequence[Metric], rows: list[dict[str, Any]], replica_cache: str) -> dict[str, Any]:
    """Summed over the replicas, but requests as the ingress answered them, and a shared cache dir's
    disk tier once (every replica on it reports the same files)."""
    fleet = {**totals(families), **request_totals(families, ingress_name("toolkv_requests_total"))}
    if replica_cache == "shared":
        for key in ("cache_entries", "cache_bytes"):
            if any("disk" in row[key] for row in rows):
                fleet[key]["disk"] = max(row[key].get("disk", 0.0) for row in rows)
    return fleet


def _fleet_engine(families: Sequence[Metric], block_tokens: int) -> dict[str, Any]:
    """The engines' series summed; the pool is every replica's (the last step is no one's)."""
    summed = engine(families, EngineView(kv_block_tokens=block_tokens))
    blocks = summed["kv_blocks"]
    blocks["total"] = blocks["used"] + blocks["free"]
    return summed


def _groups(stats: list[ReplicaAnswer]) -> list[dict[str, Any]]:
    """Every replica's RAM groups (its own cheap listing), most recently used first."""
    rows = [{**group, "replica": answer.replica} for answer in stats if answer.status == 200
            for group in answer.json()["groups"]]
    return sorted(rows, key=lambda row: row["last_used_at"], reverse=True)[:MAX_GROUP_ROWS]


def _pins(stats: list[ReplicaAnswer], replica_cache: str) -> dict[str, Any] | None:
    """Every replica's pinned groups (a group pinned in a shared cache dir is listed by each
    replica), largest first; None until a replica has loaded its model."""
    pins = {answer.replica: own for answer in stats if answer.status == 200 and (own := answer.json().get("pins"))}
    if not pins:
        return None
    groups = [{**group, "replica": replica} for replica, own in pins.items() for group in own["groups"]]
    return {**fleet_pinned(list(pins.values()), replica_cache),
            "groups": sorted(groups, key=lambda group: group["num_bytes"], reverse=True)[:MAX_GROUP_ROWS]}


def _model_name(families: Sequence[Metric]) -> str | None:
    """The served model, as the engines' vLLM-named series label it."""
    return next((s.labels["model_name"] for f in families for s in f.samples if "model_name" in s.labels), None)
