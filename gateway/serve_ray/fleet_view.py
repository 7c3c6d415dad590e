"""The ingress's view of the whole fleet, for operators: `GET /metrics` carries every replica's
series with a `replica` label (fleet totals are a `sum without (replica)` away, and dashboards
written for one gateway keep working with `sum`), plus the ingress's own routing series; its
request and cache series, which would otherwise be counted twice, are renamed `toolkv_ingress_*`.
`GET /v1/cache` lists every replica's entries, each with its `replica` (an entry in a shared
cache dir's disk tier is listed by every replica that can load it); `POST /v1/cache/warm`
compiles a group on the replica its requests will be routed to."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Sequence

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from adapters.base import ToolGroup, ToolSpec
from gateway.proxy.app import upstream_headers
from gateway.proxy.routing import affinity_key

OWN_KEPT_PREFIXES = ("toolkv_upstream_", "process_")  # the ingress's series no replica has


def install_fleet_view(app: FastAPI, replicas: Sequence[str]) -> None:
    """Replace the proxy app's `/metrics` with the fleet's and add `GET /v1/cache`; `replicas`
    are the upstream base URLs (`http://engine-0`, ...)."""
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != "/metrics"]

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        own = generate_latest(request.app.state.metrics.registry).decode()
        texts = await asyncio.gather(*(_replica_text(request, url) for url in replicas))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(FleetCollector(own, {_name(url): text for url, text in zip(replicas, texts, strict=True)}))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/cache")
    async def cache_entries(request: Request) -> Response:
        answers = await asyncio.gather(*(_get(request, url + "/v1/cache") for url in replicas))
        entries: list[object] = []
        for url, resp in zip(replicas, answers, strict=True):
            if resp.status_code != 200:  # a refused key (401/403) or a replica not ready: as it said
                return Response(resp.content, status_code=resp.status_code, media_type="application/json")
            entries += [{**entry, "replica": _name(url)} for entry in orjson.loads(resp.content)["data"]]
        return JSONResponse({"object": "list", "data": entries})

    @app.post("/v1/cache/warm")
    async def warm(request: Request) -> Response:
        state = request.app.state
        tenant = state.keyring.admin(request)
        body = await request.body()
        group_id = _warm_group_id(body)
        key = affinity_key(state.keyring.salt_for(tenant, group_id), group_id) if group_id else ""
        home = state.router.route(key, state.pool.in_flight(), state.pool.down()).order[0]
        client: httpx.AsyncClient = state.forwarder.client
        resp = await client.post(home + "/v1/cache/warm", content=body, headers=upstream_headers(request))
        if resp.status_code != 200:
            return Response(resp.content, status_code=resp.status_code, media_type="application/json")
        return JSONResponse({**orjson.loads(resp.content), "replica": _name(home)})


class FleetCollector(Collector):
    def __init__(self, own: str, replica_texts: dict[str, str]) -> None:
        self.own = own
        self.replica_texts = replica_texts

    def collect(self) -> Iterator[Metric]:
        """One family per name (the text format wants each family's lines together)."""
        merged: dict[str, Metric] = {}
        for replica, text in self.replica_texts.items():
            for family in _families(text):
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                into.samples += [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]
        for family in _families(self.own):
            name = family.name if family.name.startswith(OWN_KEPT_PREFIXES) else _ingress_name(family.name)
            into = merged.setdefault(name, Metric(name, family.documentation, family.type))
            into.samples += [s._replace(name=name + s.name.removeprefix(family.name)) for s in family.samples]
        yield from merged.values()


def _ingress_name(name: str) -> str:
    return "toolkv_ingress_" + name.removeprefix("toolkv_")


def _families(text: str) -> Iterable[Metric]:
    """Parsed families, less `_created` timestamps (the parser splits them off as untyped)."""
    return (family for family in text_string_to_metric_families(text)
            if not (family.type == "unknown" and family.name.endswith("_created")))


def _warm_group_id(body: bytes) -> str:
    """The group a warm body names, as a chat request with that system text and tools has it;
    "" when the body is not one (the replica it goes to answers for it)."""
    try:
        data = orjson.loads(body or b"{}")
        tools = [tool["function"] for tool in data.get("tools", [])]
        specs = [ToolSpec(t["name"], t.get("description"), t.get("parameters")) for t in tools]
        return ToolGroup.of(data.get("system"), specs).group_id
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError):
        return ""


async def _replica_text(request: Request, url: str) -> str:
    try:
        resp = await _get(request, url + "/metrics")
    except httpx.HTTPError:
        return ""  # an unreachable replica has no series; toolkv_upstream_up says it is down
    return resp.text if resp.status_code == 200 else ""


async def _get(request: Request, url: str) -> httpx.Response:
    """A replica's quick answer, bounded like a probe: a replica that is gone (Ray holds calls to
    it until its replacement runs) must not hold up the fleet's view."""
    client: httpx.AsyncClient = request.app.state.forwarder.client
    timeout = request.app.state.settings.upstream_connect_timeout_s
    return await client.get(url, headers=upstream_headers(request), timeout=timeout)


def _name(url: str) -> str:
    return httpx.URL(url).host
