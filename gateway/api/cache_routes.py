"""Cache management endpoints: `POST /v1/cache/warm` (`"pin": true` pins the group), `GET /v1/cache`,
`GET /v1/cache/{id}`, `DELETE /v1/cache/{id}`, `DELETE /v1/cache`, and `POST`/`DELETE
/v1/cache/{id}/pin` (pin, unpin: a change the cache dir refuses is a 507, nothing changed). They
need the admin key when API keys are set: pins are the operator's, never a tenant's. An id
is an entry's key digest (64 lowercase hex, `gateway/edge/cache_ids.py`); anything else is rejected
before it can reach the filesystem. Warming fills the shared namespace: what an open gateway, and
tenants using a group listed in `shared_groups`, look up."""

from __future__ import annotations

import asyncio
import dataclasses

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from gateway.api.state import gateway_state
from gateway.edge.cache_ids import checked_id, unknown_entry
from gateway.edge.limits import check_json_depth
from gateway.engine import QueueFull
from gateway.errors import BadRequest, CacheFilesLeft, Overloaded
from gateway.serving.cache_admin import WarmRequest, entry_dict, pin_entry, plan_warm, unpin_entry, warm_plan
from gateway.serving.runtime import Runtime

router = APIRouter()

_WRITE_TIMEOUT_S = 30.0


@router.post("/v1/cache/warm")
async def warm(request: Request) -> JSONResponse:
    """Compile a tool group now; when this returns, the entry is in RAM and (if the disk allows)
    on disk, so it also survives a restart. `"pin": true` pins it too (a 400 past
    pinned_budget_bytes: the group is warmed, not pinned)."""
    runtime = _admin_runtime(request)
    raw = await request.body()
    settings = gateway_state(request.app).settings
    # parsing, rendering and tokenizing a group is blocking work: off the event loop
    body = await asyncio.to_thread(_warm_request, raw)
    plan = await asyncio.to_thread(plan_warm, runtime.service, body, settings.max_tools, settings.max_schema_depth)
    try:
        future = warm_plan(runtime.engine, plan)
    except QueueFull:
        raise Overloaded("the server is busy: too many requests are queued; retry shortly",
                         headers={"Retry-After": "1"}) from None
    warmed = await asyncio.wrap_future(future)
    await asyncio.to_thread(runtime.store.flush, _WRITE_TIMEOUT_S)
    if body.pin:
        pinned = await asyncio.to_thread(pin_entry, runtime.admin, warmed.digest, settings.pinned_budget_bytes, "pin")
        warmed = dataclasses.replace(warmed, pinned=pinned is not None)
    elif runtime.store.pins.is_pinned(warmed.digest):
        warmed = dataclasses.replace(warmed, pinned=True)
    return JSONResponse(warmed.to_dict())


@router.get("/v1/cache")
async def list_entries(request: Request) -> JSONResponse:
    """Every entry (each says whether it is pinned), and the pinned bytes against their budget."""
    runtime = _admin_runtime(request)
    infos = await asyncio.to_thread(runtime.admin.entries)
    settings = gateway_state(request.app).settings
    return JSONResponse({"object": "list", "data": [entry_dict(i) for i in infos],
                         "pinned_bytes": runtime.store.pinned_bytes(),
                         "pinned_budget_bytes": settings.pinned_budget_bytes})


@router.get("/v1/cache/{entry_id}")
async def get_entry(entry_id: str, request: Request) -> JSONResponse:
    runtime = _admin_runtime(request)
    digest = checked_id(entry_id)
    info = await asyncio.to_thread(runtime.admin.find, digest)
    if info is None:
        raise unknown_entry(digest)
    return JSONResponse(entry_dict(info))


@router.delete("/v1/cache/{entry_id}")
async def delete_entry(entry_id: str, request: Request) -> JSONResponse:
    runtime = _admin_runtime(request)
    digest = checked_id(entry_id)
    removed = await asyncio.to_thread(runtime.admin.remove, digest)
    if await asyncio.to_thread(runtime.store.files_left, {digest}):
        raise _files_left(1)
    if not removed:
        raise unknown_entry(digest)
    return JSONResponse({"id": digest, "object": "toolkv.cache_entry.deleted", "deleted": True})


def _files_left(count: int) -> CacheFilesLeft:
    return CacheFilesLeft(f"{count} cache file(s) could not be removed (a read-only cache dir? see the log): "
                          "what was in RAM is gone, the file(s) stay and would be read again")


@router.post("/v1/cache/{entry_id}/pin")
async def pin(entry_id: str, request: Request) -> JSONResponse:
    """Pin an entry: never evicted by LRU pressure nor by the disk budget, across restarts."""
    runtime = _admin_runtime(request)
    digest = checked_id(entry_id)
    settings = gateway_state(request.app).settings
    info = await asyncio.to_thread(pin_entry, runtime.admin, digest, settings.pinned_budget_bytes)
    if info is None:
        raise unknown_entry(digest)
    return JSONResponse(entry_dict(info))


@router.delete("/v1/cache/{entry_id}/pin")
async def unpin(entry_id: str, request: Request) -> JSONResponse:
    """Unpin an entry: evictable again (it stays cached until LRU takes it)."""
    runtime = _admin_runtime(request)
    digest = checked_id(entry_id)
    info = await asyncio.to_thread(unpin_entry, runtime.admin, digest)
    if info is None:
        raise unknown_entry(digest)
    return JSONResponse(entry_dict(info))


@router.delete("/v1/cache")
async def clear(request: Request) -> JSONResponse:
    runtime = _admin_runtime(request)
    doomed = await asyncio.to_thread(runtime.store.disk_digests)
    count = await asyncio.to_thread(runtime.admin.clear)
    await asyncio.wrap_future(runtime.engine.forget_conversations())
    if left := await asyncio.to_thread(runtime.store.files_left, doomed):
        raise _files_left(left)
    return JSONResponse({"object": "toolkv.cache.cleared", "deleted": count})


def _warm_request(raw: bytes) -> WarmRequest:
    try:
        check_json_depth(orjson.loads(raw or b"{}"))
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    try:
        return WarmRequest.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
        raise BadRequest(f"invalid value for '{param or 'body'}': {first['msg']}", param=param or None) from None


def _admin_runtime(request: Request) -> Runtime:
    state = gateway_state(request.app)
    state.keyring.admin(request)  # API keys: checked before anything else
    return state.model.loaded()
