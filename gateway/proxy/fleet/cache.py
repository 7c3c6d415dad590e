"""The fleet's cache through the proxy: the single gateway's endpoints (`gateway/api/cache_routes.py`)
across the servers behind it, each answer naming them as the view does (`replica`/`replicas` on the
Ray ingress, `upstream`/`upstreams` in proxy mode). `GET /v1/cache` lists every server's entries,
each with its server (an entry in a shared cache dir's disk tier is listed by every server that can
load it), and the fleet's pinned bytes and budget; `GET /v1/cache/{id}` is that entry as a server
holding it in RAM sees it (else the one that used it last), with every server that lists it; `POST
/v1/cache/warm` compiles a group on the server its requests will be routed to; `DELETE
/v1/cache/{id}`, `DELETE /v1/cache` and `POST`/`DELETE /v1/cache/{id}/pin` go to every server (each
may hold a copy in RAM, and a shared disk entry is each one's to drop; a pinned group stays pinned
wherever it lives, `pins.py`). A server without toolkv's cache API (vLLM's 404) has no entries. The
admin key (once keys are set) is checked here first; a server that does not answer is named, never
waited for long."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from adapters.base import ToolGroup, ToolSpec
from gateway.edge.cache_ids import checked_id, unknown_entry
from gateway.errors import UpstreamUnavailable
from gateway.proxy.fan_out import UpstreamAnswer, ask
from gateway.proxy.fleet.pins import add_pin_routes
from gateway.proxy.fleet.view import CHANGE_TIMEOUT_S, FleetView, ask_members, fleet_pinned, liveness, view_of
from gateway.proxy.headers import upstream_headers
from gateway.proxy.routing import affinity_key
from gateway.proxy.state import proxy_state

router = APIRouter()
add_pin_routes(router)


@router.get("/v1/cache")
async def list_entries(request: Request) -> Response:
    proxy_state(request.app).keyring.admin(request)
    view = view_of(request)
    answers = await ask_members(request, "GET", "/v1/cache")
    if (refusal := _refusal(answers)) is not None:
        return refusal
    listings, missing = _answered(view, answers)
    if missing and len(missing) == len(answers):
        raise _unavailable(view, missing, "the cache cannot be listed")
    data = [{**entry, view.member: name} for name, listing in listings.items() for entry in listing.get("data") or ()]
    body: dict[str, Any] = {"object": "list", "data": data, **fleet_pinned(list(listings.values()), view.shared_cache)}
    if missing:
        body[f"unavailable_{view.members}"] = missing  # listed without them: an operator sees who is missing
    return JSONResponse(body)


@router.get("/v1/cache/{entry_id}")
async def get_entry(entry_id: str, request: Request) -> Response:
    proxy_state(request.app).keyring.admin(request)
    view = view_of(request)
    digest = checked_id(entry_id)
    answers = await ask_members(request, "GET", f"/v1/cache/{digest}")
    if (refusal := _refusal(answers)) is not None:
        return refusal
    copies, missing = _answered(view, answers)
    if not copies:
        raise _unavailable(view, missing, "the entry cannot be looked up") if missing else unknown_entry(digest)
    name, live = max(copies.items(), key=lambda copy: liveness(copy[1]))
    return JSONResponse({**live, view.member: name, view.members: list(copies)})


@router.delete("/v1/cache/{entry_id}")
async def delete_entry(entry_id: str, request: Request) -> Response:
    proxy_state(request.app).keyring.admin(request)
    view = view_of(request)
    digest = checked_id(entry_id)
    answers = await ask_members(request, "DELETE", f"/v1/cache/{digest}", CHANGE_TIMEOUT_S)
    if (refusal := _refusal(answers)) is not None:
        return refusal
    deleted, missing = _answered(view, answers)
    if missing:
        raise _unavailable(view, missing, f"the entry may still be there (deleted on: {', '.join(deleted) or 'none'})")
    if not deleted:
        raise unknown_entry(digest)
    return JSONResponse({"id": digest, "object": "toolkv.cache_entry.deleted", "deleted": True,
                         view.members: list(deleted)})


@router.delete("/v1/cache")
async def clear(request: Request) -> Response:
    proxy_state(request.app).keyring.admin(request)
    view = view_of(request)
    answers = await ask_members(request, "DELETE", "/v1/cache", CHANGE_TIMEOUT_S)
    if (refusal := _refusal(answers)) is not None:
        return refusal
    answered, missing = _answered(view, answers)
    cleared = [{view.member: name, "deleted": int(own.get("deleted") or 0)} for name, own in answered.items()]
    if missing:
        done = ", ".join(f"{c[view.member]} ({c['deleted']})" for c in cleared) or "none"
        raise _unavailable(view, missing, f"their entries may still be there (cleared: {done})")
    return JSONResponse({"object": "toolkv.cache.cleared", "deleted": sum(c["deleted"] for c in cleared),
                         view.members: cleared})


@router.post("/v1/cache/warm")
async def warm(request: Request) -> Response:
    """On the server the group's requests go to (the router's first choice for its key)."""
    state = proxy_state(request.app)
    tenant = state.keyring.admin(request)
    view = view_of(request)
    body = await request.body()
    group_id = _warm_group_id(body)
    key = affinity_key(state.keyring.salt_for(tenant, group_id), group_id) if group_id else ""
    home = state.router.route(key, state.pool.in_flight(), state.pool.down()).order[0]
    answer = await ask(state.forwarder.client, home, "POST", "/v1/cache/warm", content=body,
                       headers=upstream_headers(request), timeout_s=state.settings.upstream_read_timeout_s,
                       limit_bytes=state.settings.upstream_max_body_bytes)
    if answer.status is None:
        raise _unavailable(view, [view.name(home)], "the group was not warmed")
    if (warmed := answer.json_object()) is None:
        return Response(answer.body, status_code=answer.status, media_type="application/json")
    return JSONResponse({**warmed, view.member: view.name(home)})


def _answered(view: FleetView, answers: list[UpstreamAnswer]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """(each server's JSON answer by name, the servers that did not answer or failed: 5xx, or a 200
    that is not JSON; what they hold is unknown). A 404 is neither: nothing there."""
    found: dict[str, dict[str, Any]] = {}
    missing: list[str] = []
    for answer in answers:
        if (body := answer.json_object()) is not None:
            found[view.name(answer.url)] = body
        elif answer.status is None or answer.status >= 500 or answer.ok:
            missing.append(view.name(answer.url))
    return found, missing


def _refusal(answers: list[UpstreamAnswer]) -> Response | None:
    """A server's client error other than "not found" (a refused key: every server says the same),
    passed on as it said it."""
    for a in answers:
        if a.status is not None and 400 <= a.status < 500 and a.status != 404:
            return Response(a.body, status_code=a.status, media_type="application/json")
    return None


def _unavailable(view: FleetView, names: list[str], consequence: str) -> UpstreamUnavailable:
    return UpstreamUnavailable(f"{view.member} {', '.join(names)} did not answer: {consequence}; retry shortly",
                               headers={"Retry-After": "1"})


def _warm_group_id(body: bytes) -> str:
    """The group a warm body names, as a chat request with that system text and tools has it;
    "" when the body is not one (the server it goes to answers for it)."""
    try:
        data = orjson.loads(body or b"{}")
        tools = [tool["function"] for tool in data.get("tools", [])]
        specs = [ToolSpec(t["name"], t.get("description"), t.get("parameters")) for t in tools]
        return ToolGroup.of(data.get("system"), specs).group_id
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError, RecursionError):
        return ""
