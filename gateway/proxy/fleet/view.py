"""How the app shows the servers behind it (`FleetView`), chosen when the app is built: proxy mode's
upstreams (`upstream_view`) or the Ray ingress's engine replicas (`replica_view`); and asking them
all at once for the view. Calls go through the proxy's client (on the Ray ingress, the replicas'
deployment handles) with the request's upstream headers (the proxy's `upstream_api_key`; on the
ingress, the client's own key, which each replica checks as a single gateway would), each bounded
(gateway/proxy/fan_out.py): a server that is gone costs a short wait and its name in the answer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import Request

from gateway.proxy.fan_out import UpstreamAnswer, ask_all
from gateway.proxy.headers import upstream_headers
from gateway.proxy.state import proxy_state

if TYPE_CHECKING:
    from gateway.proxy.fleet.dashboard import Dashboard

CHANGE_TIMEOUT_S = 30.0  # deleting entries: a server may be writing or sweeping its disk tier


@dataclass(frozen=True, slots=True)
class FleetView:
    mode: str  # /health's and the dashboard's `mode`
    member: str  # one server, in answers ("upstream", "replica"), and the label of its series in the merge
    name: Callable[[str], str]  # a server's name in answers, from its base URL
    name_key: str  # the key of that name in /health's rows
    own_prefix: str  # the app's own request and cache series in the merge (else counted twice): renamed so
    metrics_path: str  # where the merged series are served (the app's own stay at /metrics when not there)
    shared_cache: bool  # the servers share one cache dir: its disk tier and one pin budget counted once
    dashboard: Dashboard | None = None  # the page at `/` and its numbers: gateway/api/dashboard.py, handed in

    @property
    def members(self) -> str:
        return self.member + "s"


def upstream_view(dashboard: Dashboard | None = None) -> FleetView:
    """Proxy mode: upstreams named by URL, each with its own cache; `/metrics` stays the proxy's own
    (the upstreams have addresses of their own to scrape) and the merge is `/metrics/fleet`."""
    return FleetView(mode="proxy", member="upstream", name=str, name_key="url", own_prefix="toolkv_proxy_",
                     metrics_path="/metrics/fleet", shared_cache=False, dashboard=dashboard)


def replica_view(dashboard: Dashboard | None = None, shared_cache: bool = True) -> FleetView:
    """The Ray ingress: replicas named by host (`engine-0`); `/metrics` is the merge (a replica has no
    address of its own); `shared_cache` when `replica_cache` is `shared`."""
    return FleetView(mode="replicas", member="replica", name=host_name, name_key="name", own_prefix="toolkv_ingress_",
                     metrics_path="/metrics", shared_cache=shared_cache, dashboard=dashboard)


def host_name(url: str) -> str:
    return httpx.URL(url).host


def view_of(request: Request) -> FleetView:
    view: FleetView = proxy_state(request.app).fleet_view
    return view


async def ask_members(request: Request, method: str, path: str, timeout_s: float | None = None,
                      content: bytes | None = None) -> list[UpstreamAnswer]:
    """Every server's answer to `method path`, in their order. The default bound is a probe's
    (`upstream_connect_timeout_s`): reads are quick on a server that is there."""
    state = proxy_state(request.app)
    headers = upstream_headers(request)
    if content is None:
        headers.pop("content-type")
    bound = timeout_s if timeout_s is not None else state.settings.upstream_connect_timeout_s
    return await ask_all(state.forwarder.client, state.pool.urls, method, path, timeout_s=bound, headers=headers,
                         limit_bytes=state.settings.upstream_max_body_bytes, content=content)


def fleet_status(rows: list[dict[str, Any]]) -> str:
    """`ok` when every server is, `degraded` when some are, `failed` when none is."""
    serving = sum(r["status"] == "ok" for r in rows)
    return "ok" if serving == len(rows) else ("degraded" if serving else "failed")


def fleet_pinned(servers: list[dict[str, Any]], shared_cache: bool) -> dict[str, int]:
    """The fleet's `pinned_bytes` and `pinned_budget_bytes` from the servers' (each a dict with
    both): servers sharing a cache dir share one pin file and one budget (the largest count is
    the freshest view of it); with separate dirs each has its own, and the fleet's are the sums."""
    if not servers:
        return {"pinned_bytes": 0, "pinned_budget_bytes": 0}
    join = max if shared_cache else sum
    return {key: int(join(int(s.get(key) or 0) for s in servers)) for key in ("pinned_bytes", "pinned_budget_bytes")}


def liveness(entry: dict[str, Any]) -> tuple[bool, float]:
    """Which server's copy of a cache entry to show: one holding it in RAM, else the one that used it last."""
    return "ram" in entry.get("tiers", ()), float(entry.get("last_used_at") or 0.0)
