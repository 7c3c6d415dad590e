"""What the proxy asks of every upstream at once: `/health` (their reachability, which also
marks them up or down for routing; on every `GET /health` and every `upstream_probe_s` in the
background; in tenant mode an upstream found up that is not yet known to keep tenants apart, or
back after being down, is checked again: gateway/proxy/tenancy.py) and `/v1/models` (the union of
their lists). Both are asked of every upstream at once (gateway/proxy/fan_out.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import orjson

from gateway.errors import BadGateway, UpstreamUnavailable
from gateway.proxy import tenancy
from gateway.proxy.fan_out import UpstreamAnswer, ask_all
from gateway.proxy.upstreams import UpstreamPool

if TYPE_CHECKING:  # its parts: the state names their types
    from gateway.proxy.state import ProxyState

log = logging.getLogger(__name__)

UNAVAILABLE = ("loading", "failed")  # a toolkv upstream's /health while it cannot serve
PROBE_BYTES = 1024**2  # a /health answer larger than this is an error


async def probe_all(state: ProxyState) -> list[dict[str, Any]]:
    """Each upstream's status (`ok`, `loading`, `failed`, `error`, `unreachable`) and requests in flight."""
    pool: UpstreamPool = state.pool
    safety: tenancy.TenantSafety = state.tenant_safety
    answers = await ask_all(state.forwarder.client, pool.urls, "GET", "/health", limit_bytes=PROBE_BYTES,
                            timeout_s=state.settings.upstream_connect_timeout_s)
    statuses = [health_status(answer) for answer in answers]
    was_down = pool.down()
    in_flight = pool.in_flight()
    for url, status in zip(pool.urls, statuses, strict=True):
        (pool.mark_up if status == "ok" else pool.mark_down)(url)
    if safety.required:
        recheck = tuple(url for url, status in zip(pool.urls, statuses, strict=True)
                        if status == "ok" and (url in was_down or not safety.usable(url)))
        if recheck:
            await tenancy.check_all(state, recheck)
    rows: list[dict[str, Any]] = [{"url": url, "status": status, "in_flight": in_flight[url]}
                                  for url, status in zip(pool.urls, statuses, strict=True)]
    if safety.required:
        for row in rows:
            row["tenants_apart"] = safety.usable(row["url"])
    return rows


async def watch(state: ProxyState, period_s: float) -> None:
    """Probe every upstream each `period_s` until cancelled, so that one which stopped answering is
    routed around before a request finds out (and one back in service gets its groups back)."""
    while True:
        await asyncio.sleep(period_s)
        try:
            await probe_all(state)
        except Exception:  # a probe round that broke must not end the watch
            log.exception("probing the upstreams failed")


def health_status(answer: UpstreamAnswer) -> str:
    """What an upstream's `/health` answer says: `ok`, `loading`, `failed`, `error`, `unreachable`."""
    if answer.failure is not None:
        return "unreachable" if answer.failure == "unreachable" else "error"
    said = _status_field(answer.body)
    if said in UNAVAILABLE:
        return said
    # 404: it answers, but has no health route (llama-cpp-python's server): reachable is all we learn
    return "ok" if answer.status in (200, 404) else "error"


def _status_field(body: bytes) -> str | None:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:  # vLLM's /health answers 200 with an empty body
        return None
    status = value.get("status") if isinstance(value, dict) else None
    return status if isinstance(status, str) else None


async def models(state: ProxyState, headers: dict[str, str]) -> dict[str, Any]:
    """Every model the upstreams list, once each (the first upstream's entry of an id wins)."""
    pool: UpstreamPool = state.pool
    answers = await ask_all(state.forwarder.client, pool.urls, "GET", "/v1/models", headers=headers,
                            limit_bytes=state.settings.upstream_max_body_bytes,
                            timeout_s=state.settings.upstream_connect_timeout_s)
    lists = [_model_list(answer) for answer in answers]
    listed = [entries for entries in lists if isinstance(entries, list)]
    if not listed:
        if any(reason == "error" for reason in lists):
            raise BadGateway("no upstream could list its models")
        raise UpstreamUnavailable("no upstream is reachable", headers={"Retry-After": "1"})
    seen: dict[str, dict[str, Any]] = {}
    for entries in listed:
        for entry in entries:
            seen.setdefault(str(entry.get("id")), entry)
    return {"object": "list", "data": list(seen.values())}


def _model_list(answer: UpstreamAnswer) -> list[dict[str, Any]] | str:
    """The upstream's model entries, or why not: `error` (an answer that is not a list) or `unreachable`."""
    if answer.failure == "unreachable":
        return "unreachable"
    listing = answer.json_object()
    data = listing.get("data") if listing is not None else None
    if not isinstance(data, list):
        return "error"
    return [entry for entry in data if isinstance(entry, dict)]
