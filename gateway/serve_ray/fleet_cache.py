"""The fleet's cache through the ingress: the single gateway's endpoints (`gateway/api/cache_routes.py`)
across the engine replicas, each answer naming them. `GET /v1/cache` lists every replica's
entries, each with its `replica` (an entry in a shared cache dir's disk tier is listed by every
replica that can load it), and the fleet's pinned bytes and budget; `GET /v1/cache/{id}` is that
entry as a replica holding it in RAM sees it (else the one that used it last), with every replica
that lists it; `POST /v1/cache/warm` compiles a group on the replica its requests will be routed
to; `DELETE /v1/cache/{id}`, `DELETE /v1/cache` and `POST`/`DELETE /v1/cache/{id}/pin` go to every
replica (each may hold a copy in RAM, and a shared disk entry is each one's to drop; a pinned
group stays pinned wherever it lives, gateway/proxy/cache_pins.py). The admin key (once keys are
set) is checked here first; a replica that does not answer is named, never waited for long."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from adapters.base import ToolGroup, ToolSpec
from gateway.edge.cache_ids import checked_id, unknown_entry
from gateway.errors import UpstreamUnavailable
from gateway.proxy.cache_pins import add_pin_routes
from gateway.proxy.headers import upstream_headers
from gateway.proxy.routing import affinity_key
from gateway.serve_ray.fleet_calls import CHANGE_TIMEOUT_S, ReplicaAnswer, ask_replicas, fleet_pinned, replica_name

router = APIRouter()
add_pin_routes(router, replica_name, "replicas")


@router.get("/v1/cache")
async def list_entries(request: Request) -> Response:
    request.app.state.keyring.admin(request)
    answers = await ask_replicas(request, "GET", "/v1/cache")
    if (refusal := _refusal(answers)) is not None:
        return refusal
    listings = {a.replica: a.json() for a in _answered(answers)}
    body: dict[str, Any] = {"object": "list", "data": [{**entry, "replica": replica}
                                                       for replica, listing in listings.items()
                                                       for entry in listing["data"]],
                            **fleet_pinned(list(listings.values()), request.app.state.settings.replica_cache)}
    if missing := _missing(answers):
        if len(missing) == len(answers):
            raise _unavailable(missing, "the cache cannot be listed")
        body["unavailable_replicas"] = missing  # listed without them: an operator sees who is missing
    return JSONResponse(body)


@router.get("/v1/cache/{entry_id}")
async def get_entry(entry_id: str, request: Request) -> Response:
    request.app.state.keyring.admin(request)
    digest = checked_id(entry_id)
    answers = await ask_replicas(request, "GET", f"/v1/cache/{digest}")
    if (refusal := _refusal(answers)) is not None:
        return refusal
    copies = [{**a.json(), "replica": a.replica} for a in _answered(answers)]
    if not copies:
        missing = _missing(answers)
        raise _unavailable(missing, "the entry cannot be looked up") if missing else unknown_entry(digest)
    live = max(copies, key=lambda entry: ("ram" in entry.get("tiers", ()), float(entry.get("last_used_at", 0.0))))
    return JSONResponse({**live, "replicas": [copy["replica"] for copy in copies]})


@router.delete("/v1/cache/{entry_id}")
async def delete_entry(entry_id: str, request: Request) -> Response:
    request.app.state.keyring.admin(request)
    digest = checked_id(entry_id)
    answers = await ask_replicas(request, "DELETE", f"/v1/cache/{digest}", CHANGE_TIMEOUT_S)
    if (refusal := _refusal(answers)) is not None:
        return refusal
    deleted = [a.replica for a in _answered(answers)]
    if missing := _missing(answers):
        raise _unavailable(missing, f"the entry may still be there (deleted on: {', '.join(deleted) or 'none'})")
    if not deleted:
        raise unknown_entry(digest)
    return JSONResponse({"id": digest, "object": "toolkv.cache_entry.deleted", "deleted": True,
                         "replicas": deleted})


@router.delete("/v1/cache")
async def clear(request: Request) -> Response:
    request.app.state.keyring.admin(request)
    answers = await ask_replicas(request, "DELETE", "/v1/cache", CHANGE_TIMEOUT_S)
    if (refusal := _refusal(answers)) is not None:
        return refusal
    cleared = [{"replica": a.replica, "deleted": a.json()["deleted"]}
               for a in _answered(answers)]
    if missing := _missing(answers):
        done = ", ".join(f"{c['replica']} ({c['deleted']})" for c in cleared) or "none"
        raise _unavailable(missing, f"their entries may still be there (cleared: {done})")
    return JSONResponse({"object": "toolkv.cache.cleared", "deleted": sum(c["deleted"] for c in cleared),
                         "replicas": cleared})


@router.post("/v1/cache/warm")
async def warm(request: Request) -> Response:
    """On the replica the group's requests go to (the router's first choice for its key)."""
    state = request.app.state
    tenant = state.keyring.admin(request)
    body = await request.body()
    group_id = _warm_group_id(body)
    key = affinity_key(state.keyring.salt_for(tenant, group_id), group_id) if group_id else ""
    home = state.router.route(key, state.pool.in_flight(), state.pool.down()).order[0]
    client: httpx.AsyncClient = state.forwarder.client
    try:
        resp = await client.post(home + "/v1/cache/warm", content=body, headers=upstream_headers(request))
    except httpx.HTTPError:
        raise _unavailable([replica_name(home)], "the group was not warmed") from None
    if resp.status_code != 200:
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")
    return JSONResponse({**orjson.loads(resp.content), "replica": replica_name(home)})


def _answered(answers: list[ReplicaAnswer]) -> list[ReplicaAnswer]:
    return [a for a in answers if a.status == 200]


def _missing(answers: list[ReplicaAnswer]) -> list[str]:
    """Replicas that did not answer, or failed (5xx): what they hold is unknown."""
    return [a.replica for a in answers if a.status is None or a.status >= 500]


def _refusal(answers: list[ReplicaAnswer]) -> Response | None:
    """A replica's client error other than "not found" (a refused key: every replica says the same),
    passed on as it said it."""
    for a in answers:
        if a.response is not None and 400 <= a.response.status_code < 500 and a.response.status_code != 404:
            return Response(a.response.content, status_code=a.response.status_code, media_type="application/json")
    return None


def _unavailable(replicas: list[str], consequence: str) -> UpstreamUnavailable:
    return UpstreamUnavailable(f"replica {', '.join(replicas)} did not answer: {consequence}; retry shortly",
                               headers={"Retry-After": "1"})


def _warm_group_id(body: bytes) -> str:
    """The group a warm body names, as a chat request with that system text and tools has it;
    "" when the body is not one (the replica it goes to answers for it)."""
    try:
        data = orjson.loads(body or b"{}")
        tools = [tool["function"] for tool in data.get("tools", [])]
        specs = [ToolSpec(t["name"], t.get("description"), t.get("parameters")) for t in tools]
        return ToolGroup.of(data.get("system"), specs).group_id
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError, RecursionError):
        return ""
