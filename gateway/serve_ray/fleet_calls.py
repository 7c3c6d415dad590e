"""The ingress asking every engine replica at once, for the operator's view (metrics, health, the
cache, the dashboard). Calls go through the proxy's client, so through the replicas' deployment
handles and with the client's key (a replica checks it as a single gateway would); each is
bounded, so a replica that is gone (Ray holds calls to it until its replacement runs) costs a
short wait and its name in the answer, never a view that hangs."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from fastapi import Request

from gateway.proxy import upstream_info
from gateway.proxy.headers import upstream_headers

CHANGE_TIMEOUT_S = 30.0  # deleting entries: a replica may be writing or sweeping its disk tier


@dataclass(frozen=True, slots=True)
class ReplicaAnswer:
    replica: str  # "engine-0"
    response: httpx.Response | None  # None: no answer in time (gone, restarting, or unreachable)

    @property
    def status(self) -> int | None:
        return self.response.status_code if self.response is not None else None

    def json(self) -> Any:
        assert self.response is not None, "only an answer has a body"
        return orjson.loads(self.response.content)


def replica_urls(request: Request) -> tuple[str, ...]:
    """The replicas' base URLs (`http://engine-0`, ...), in order."""
    urls: tuple[str, ...] = request.app.state.replica_urls
    return urls


def replica_name(url: str) -> str:
    return httpx.URL(url).host


async def ask_replicas(request: Request, method: str, path: str, timeout_s: float | None = None) -> list[ReplicaAnswer]:
    """Every replica's answer to `method path` (no body), in replica order. The default bound is a
    probe's (`upstream_connect_timeout_s`): reads are quick on a replica that is there."""
    bound = timeout_s if timeout_s is not None else request.app.state.settings.upstream_connect_timeout_s
    return list(await asyncio.gather(*(_ask(request, method, url + path, bound) for url in replica_urls(request))))


async def _ask(request: Request, method: str, url: str, timeout_s: float) -> ReplicaAnswer:
    client: httpx.AsyncClient = request.app.state.forwarder.client
    headers = {k: v for k, v in upstream_headers(request).items() if k != "content-type"}  # no body
    try:
        response = await client.request(method, url, headers=headers, timeout=timeout_s)
    except httpx.HTTPError:
        return ReplicaAnswer(replica_name(url), None)
    return ReplicaAnswer(replica_name(url), response)


async def replica_health(request: Request) -> list[dict[str, Any]]:
    """Each replica's `name`, `status` (`ok`, `loading`, `failed`, `error` or `unreachable`, from
    its `/health`) and `in_flight` (requests the ingress routed to it). Probing also marks each
    up or down for routing, as proxy mode's `/health` does."""
    probes = await upstream_info.probe_all(request.app.state)
    return [{"name": replica_name(p["url"]), "status": p["status"], "in_flight": p["in_flight"]} for p in probes]


def fleet_status(replicas: list[dict[str, Any]]) -> str:
    """`ok` when every replica is, `degraded` when some are, `failed` when none is."""
    serving = sum(r["status"] == "ok" for r in replicas)
    return "ok" if serving == len(replicas) else ("degraded" if serving else "failed")


def fleet_pinned(replicas: list[dict[str, Any]], replica_cache: str) -> dict[str, int]:
    """The fleet's `pinned_bytes` and `pinned_budget_bytes` from the replicas' (each a dict with
    both): replicas sharing a cache dir share one pin file and one budget (the largest count is
    the freshest view of it); with separate dirs each has its own, and the fleet's are the sums."""
    if not replicas:
        return {"pinned_bytes": 0, "pinned_budget_bytes": 0}
    join = max if replica_cache == "shared" else sum
    return {key: int(join(int(r.get(key) or 0) for r in replicas)) for key in ("pinned_bytes", "pinned_budget_bytes")}
