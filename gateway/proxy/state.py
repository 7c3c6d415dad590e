"""What the proxy app owns, typed: one `ProxyState`, built with the app (`create_proxy_app`) and
read through `proxy_state`, so that every read is checked. Its types are named for the checker
only: the modules that read it (the tenancy checks, the headers, the fleet view) are its parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.applications import Starlette

if TYPE_CHECKING:
    from gateway.edge.admission import KeyRing, Preparer, TenantQuota
    from gateway.proxy.fleet.dashboard import TtftWindows
    from gateway.proxy.fleet.view import FleetView
    from gateway.proxy.forward import Forwarder
    from gateway.proxy.metrics import ProxyMetrics
    from gateway.proxy.response_homes import ResponseHomes
    from gateway.proxy.routing import Router
    from gateway.proxy.tenancy import TenantSafety
    from gateway.proxy.upstreams import UpstreamPool
    from gateway.settings import Settings


@dataclass(frozen=True, slots=True)
class ProxyState:
    settings: Settings
    metrics: ProxyMetrics
    keyring: KeyRing
    quota: TenantQuota
    preparer: Preparer
    pool: UpstreamPool  # the upstreams, their in-flight counts and which are down
    forwarder: Forwarder  # the one client to every upstream (closed when the app stops)
    router: Router
    response_homes: ResponseHomes  # which upstream keeps a Responses id
    tenant_safety: TenantSafety
    fleet_view: FleetView
    ttft_windows: TtftWindows | None  # the dashboard's TTFT chart, with a dashboard


def proxy_state(app: Starlette) -> ProxyState:
    state = app.state.proxy
    if not isinstance(state, ProxyState):
        raise TypeError(f"not a proxy app's state: {type(state).__name__}")
    return state
