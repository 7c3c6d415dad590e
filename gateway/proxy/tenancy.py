"""Keeping tenants apart on the upstreams, in `upstream_cache_salt = "tenant"` mode on a proxy with
API keys. Each request names its tenant to the upstream two ways: vLLM's `cache_salt` in the body
(the group's salt, gateway/proxy/shaping.py) and toolkv's `X-Toolkv-Tenant` header (the tenant's
own salt), which a toolkv upstream honours only from a key in its `trusted_proxy_keys` and refuses
(403) from any other (gateway/edge/admission.py). An upstream that honours neither serves every tenant
from one cache, so one tenant's `cached_tokens` would confirm another's prompts: such an upstream
gets no request.

What an upstream can do is learnt from its `GET /version`:
- a toolkv says `"tenant_salt": true`; then its `GET /v1/models` with this proxy's key and a tenant
  header must pass the key check: refused (401/403) means it does not trust this proxy;
- a vLLM says its version (0.9 and later honour `cache_salt`), and its `/v1/models` entries are
  `owned_by: "vllm"` (another server's /version could say any number);
- anything else (no /version, an older toolkv, llama.cpp's server, SGLang) cannot.
At start-up the proxy checks every upstream and refuses to start when one that answers cannot (a
configuration error, named with the fix); one that does not answer yet is checked when a probe
finds it up (and again whenever one comes back after being down), and gets no request until an
answer says it keeps tenants apart."""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import httpx
import orjson

from gateway.edge.admission import TENANT_HEADER
from gateway.errors import UpstreamUnavailable
from gateway.proxy.bounded import Unreadable, fetch
from gateway.proxy.routing import Route
from gateway.settings import Settings

if TYPE_CHECKING:  # its parts: the state names their types
    from gateway.proxy.state import ProxyState

log = logging.getLogger(__name__)

VLLM_CACHE_SALT = (0, 9)  # the first vLLM release whose requests take `cache_salt`
PROBE_TENANT = "toolkv-proxy-check"  # the tenant named when asking a toolkv upstream whether it trusts us
PROBE_BYTES = 1024**2  # a /version or /v1/models answer larger than this is no answer

Verdict = Literal["ok", "refused", "unknown"]


class TenantsNotKeptApart(RuntimeError):
    """The proxy would send tenants to an upstream that shares one cache between them."""


@dataclass(frozen=True, slots=True)
class Check:
    verdict: Verdict  # ok: keeps tenants apart; refused: answered that it cannot; unknown: not known yet
    reason: str


class TenantSafety:
    """Which upstreams are known to keep tenants apart. `required` is False when there are no
    tenants to keep apart (salting off, or an open proxy): then every upstream is usable."""

    def __init__(self, urls: tuple[str, ...], required: bool) -> None:
        self.required = required
        self.checks = dict.fromkeys(urls, Check("unknown", "not checked yet"))

    def usable(self, url: str) -> bool:
        return not self.required or self.checks[url].verdict == "ok"

    def restrict(self, route: Route) -> Route:
        """`route` less the upstreams not known to keep tenants apart; 503 when that is all of them."""
        if not self.required:
            return route
        order = tuple(url for url in route.order if self.usable(url))
        if not order:
            raise UpstreamUnavailable("no upstream is known to keep tenants apart yet (upstream_cache_salt = "
                                      "\"tenant\")", headers={"Retry-After": "1"})
        if order == route.order:
            return route
        return Route(order, route.reason if order[0] == route.order[0] else "failover")

    def note(self, url: str, check: Check) -> None:
        before = self.checks[url]
        self.checks[url] = check
        if check.verdict == "refused" and before.verdict != "refused":
            log.error("upstream %s gets no requests: it cannot keep tenants apart (%s)", url, check.reason)
        elif check.verdict == "ok" and before.verdict != "ok":
            log.info("upstream %s keeps tenants apart (%s)", url, check.reason)


def required(settings: Settings, keyring_open: bool) -> bool:
    return settings.upstream_cache_salt == "tenant" and not keyring_open


async def check_all(state: ProxyState, urls: tuple[str, ...] | None = None) -> None:
    """Check `urls` (every upstream by default) and note what each can do."""
    safety: TenantSafety = state.tenant_safety
    urls = tuple(safety.checks) if urls is None else urls
    checks = await asyncio.gather(*(check(state, url) for url in urls))
    for url, result in zip(urls, checks, strict=True):
        safety.note(url, result)


async def check_at_start(state: ProxyState) -> None:
    """Every upstream, before the proxy serves: TenantsNotKeptApart when one that answered cannot."""
    safety: TenantSafety = state.tenant_safety
    if not safety.required:
        return
    await check_all(state)
    refused = [(n, url, c.reason) for n, (url, c) in enumerate(safety.checks.items(), 1) if c.verdict == "refused"]
    if refused:
        named = "; ".join(f"upstream {n} ({url}): {reason}" for n, url, reason in refused)
        raise TenantsNotKeptApart(f"upstream_cache_salt = \"tenant\", but an upstream would serve every tenant from "
                                  f"one cache: {named}")
    for url, result in safety.checks.items():
        if result.verdict == "unknown":
            log.warning("upstream %s gets no requests until it answers that it keeps tenants apart (%s)",
                        url, result.reason)


async def check(state: ProxyState, url: str) -> Check:
    """Whether the upstream at `url` keeps tenants apart, from its /version (and a toolkv's key check)."""
    settings: Settings = state.settings
    try:
        resp, body = await fetch(state.forwarder.client, "GET", url + "/version", limit=PROBE_BYTES,
                                 timeout_s=settings.upstream_connect_timeout_s)
    except (httpx.HTTPError, Unreadable) as exc:
        return Check("unknown", f"/version: {type(exc).__name__}")
    if resp.status_code >= 500:
        return Check("unknown", f"/version answered {resp.status_code}")
    info = _object(body) if resp.status_code == 200 else None
    if info is not None and info.get("tenant_salt") is True:
        return await _trusts_us(state, url)
    version = info.get("version") if info is not None else None
    if isinstance(version, str) and (release := _release(version)) is not None and release >= VLLM_CACHE_SALT:
        return await _is_vllm(state, url, version[:40])
    said = f"version {version[:40]!r}" if isinstance(version, str) else f"/version answered {resp.status_code}"
    return Check("refused", f"{said}: {NEITHER}")


NEITHER = ("neither a toolkv that takes X-Toolkv-Tenant nor vLLM 0.9 or later (cache_salt); set "
           "upstream_cache_salt = \"off\" only if every key is one tenant")


async def _models(state: ProxyState, url: str, tenant: bool) -> tuple[int, dict[str, Any] | None] | str:
    """The upstream's `/v1/models` status and JSON object, asked with this proxy's key (and a
    tenant header when `tenant`); why not, when it did not answer."""
    settings: Settings = state.settings
    headers = {TENANT_HEADER: PROBE_TENANT} if tenant else {}
    if settings.upstream_api_key:
        headers["authorization"] = f"Bearer {settings.upstream_api_key}"
    try:
        resp, body = await fetch(state.forwarder.client, "GET", url + "/v1/models", limit=PROBE_BYTES,
                                 timeout_s=settings.upstream_connect_timeout_s, headers=headers)
    except (httpx.HTTPError, Unreadable) as exc:
        return f"/v1/models: {type(exc).__name__}"
    return resp.status_code, _object(body)


async def _is_vllm(state: ProxyState, url: str, version: str) -> Check:
    answer = await _models(state, url, tenant=False)
    if isinstance(answer, str):
        return Check("unknown", answer)
    status, listing = answer
    if status != 200:
        return Check("unknown", f"/v1/models answered {status}")
    entries = listing.get("data") if listing is not None else None
    if isinstance(entries, list) and any(isinstance(e, dict) and e.get("owned_by") == "vllm" for e in entries):
        return Check("ok", f"vLLM {version} takes cache_salt")
    return Check("refused", f"version {version!r} but its models are not vLLM's: {NEITHER}")


async def _trusts_us(state: ProxyState, url: str) -> Check:
    """A toolkv upstream: does it take this proxy's key as a trusted proxy's?"""
    settings: Settings = state.settings
    answer = await _models(state, url, tenant=True)
    if isinstance(answer, str):
        return Check("unknown", answer)
    status, _ = answer
    if status == 200:
        return Check("ok", "a toolkv that takes this proxy's X-Toolkv-Tenant")
    if status in (401, 403):
        fix = ("list this proxy's upstream_api_key in the upstream's trusted_proxy_keys" if settings.upstream_api_key
               else "set upstream_api_key here and list it in the upstream's trusted_proxy_keys")
        return Check("refused", f"a toolkv that does not trust this proxy to name tenants: {fix}")
    return Check("unknown", f"/v1/models answered {status}")  # e.g. 503 while its model loads


def _object(body: bytes) -> dict[str, Any] | None:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as `0.9.1` or `0.10.0rc1+cu126`."""
    match = re.match(r"v?(\d+)\.(\d+)", version.strip())
    return (int(match[1]), int(match[2])) if match else None
