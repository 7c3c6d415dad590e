"""What the proxy asks of every upstream at once: `/health` (their reachability, which also
marks them up or down for routing; on every `GET /health` and every `upstream_probe_s` in the
background) and `/v1/models` (the union of their lists)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from gateway.errors import BadGateway, UpstreamUnavailable
from gateway.proxy.upstreams import UpstreamPool

log = logging.getLogger(__name__)

UNAVAILABLE = ("loading", "failed")  # a toolkv upstream's /health while it cannot serve


async def probe_all(state: Any) -> list[dict[str, Any]]:
    """Each upstream's status (`ok`, `loading`, `failed`, `error`, `unreachable`) and requests in flight."""
    pool: UpstreamPool = state.pool
    statuses = await asyncio.gather(*(probe(state, url) for url in pool.urls))
    in_flight = pool.in_flight()
    for url, status in zip(pool.urls, statuses, strict=True):
        (pool.mark_up if status == "ok" else pool.mark_down)(url)
    return [{"url": url, "status": status, "in_flight": in_flight[url]}
            for url, status in zip(pool.urls, statuses, strict=True)]


async def watch(state: Any, period_s: float) -> None:
    """Probe every upstream each `period_s` until cancelled, so that one which stopped answering is
    routed around before a request finds out (and one back in service gets its groups back)."""
    while True:
        await asyncio.sleep(period_s)
        try:
            await probe_all(state)
        except Exception:  # a probe round that broke must not end the watch
            log.exception("probing the upstreams failed")


async def probe(state: Any, url: str) -> str:
    client: httpx.AsyncClient = state.forwarder.client
    try:
        resp = await client.get(url + "/health", timeout=state.settings.upstream_connect_timeout_s)
    except httpx.HTTPError:
        return "unreachable"
    said = _status_field(resp)
    if said in UNAVAILABLE:
        return said
    # 404: it answers, but has no health route (llama-cpp-python's server): reachable is all we learn
    return "ok" if resp.status_code in (200, 404) else "error"


def _status_field(resp: httpx.Response) -> str | None:
    try:
        body = resp.json()
    except ValueError:  # vLLM's /health answers 200 with an empty body
        return None
    status = body.get("status") if isinstance(body, dict) else None
    return status if isinstance(status, str) else None


async def models(state: Any, headers: dict[str, str]) -> dict[str, Any]:
    """Every model the upstreams list, once each (the first upstream's entry of an id wins)."""
    pool: UpstreamPool = state.pool
    lists = await asyncio.gather(*(_model_list(state, url, headers) for url in pool.urls))
    answers = [entries for entries in lists if isinstance(entries, list)]
    if not answers:
        if any(reason == "error" for reason in lists):
            raise BadGateway("no upstream could list its models")
        raise UpstreamUnavailable("no upstream is reachable", headers={"Retry-After": "1"})
    seen: dict[str, dict[str, Any]] = {}
    for entries in answers:
        for entry in entries:
            seen.setdefault(str(entry.get("id")), entry)
    return {"object": "list", "data": list(seen.values())}


async def _model_list(state: Any, url: str, headers: dict[str, str]) -> list[dict[str, Any]] | str:
    """The upstream's model entries, or why not: `error` (an answer that is not a list) or `unreachable`."""
    client: httpx.AsyncClient = state.forwarder.client
    try:
        resp = await client.get(url + "/v1/models", headers=headers,
                                timeout=state.settings.upstream_connect_timeout_s)
    except httpx.HTTPError:
        return "unreachable"
    try:
        data = resp.json().get("data") if resp.status_code == 200 else None
    except (ValueError, AttributeError):
        data = None
    if not isinstance(data, list):
        return "error"
    return [entry for entry in data if isinstance(entry, dict)]
