"""Tenant mode (`upstream_cache_salt = "tenant"` on a proxy with keys) uses only upstreams that
keep tenants apart (issue 25, item 1): a toolkv that trusts the proxy's key or a vLLM that takes
`cache_salt`. The proxy refuses to start against one that answers that it cannot, and one whose
answer is not known yet gets no request until a probe learns it can. The end-to-end test with a
real toolkv behind a real proxy is tests/security/test_tenants_behind_proxy.py."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from gateway.edge.admission import _salt
from gateway.proxy.app import create_proxy_app
from gateway.proxy.tenancy import TenantsNotKeptApart
from gateway.settings import load_settings
from tests.proxy.conftest import home_of, messages, proxy, tools_of

TOOLS = tools_of([("alpha", 5), ("bravo", 12)])
KEYS = ("key-a", "key-b")
TENANT = {"api_keys": KEYS, "upstream_api_key": "up-secret", "upstream_cache_salt": "tenant"}


def body(system: str = "You are a tenant's.") -> dict[str, Any]:
    return {"model": "m", "messages": messages(system, "hi"), "tools": TOOLS}


def post(live: Any, payload: dict[str, Any], key: str = KEYS[0]) -> httpx.Response:
    return httpx.post(live.api_url + "/chat/completions", json=payload, timeout=60,
                      headers={"authorization": f"Bearer {key}"})


def start(upstreams: list[Any], **overrides: Any) -> None:
    """Run the proxy's start-up (and shut-down) alone."""
    settings = load_settings(overrides={"upstreams": tuple(u.base_url for u in upstreams), "upstream_probe_s": 0,
                                        **overrides}, environ={})
    app = create_proxy_app(settings)

    async def lifespan() -> None:
        async with app.router.lifespan_context(app):
            pass

    asyncio.run(lifespan())


@pytest.mark.parametrize("unable", [{"tenant_salt": False}, {"like_llama_cpp_python": True},
                                    {"vllm_version": "0.8.5"}, {"models_status": 403}])
def test_a_proxy_refuses_to_start_against_an_upstream_that_cannot_keep_tenants_apart(fakes, unable):
    _, upstreams = fakes
    for name, value in unable.items():
        setattr(upstreams[1], name, value)
    with pytest.raises(TenantsNotKeptApart, match=r"upstream 2 \(http://127\.0\.0\.1:\d+\)"):
        start(upstreams, **TENANT)
    start(upstreams, upstream_cache_salt="tenant")  # an open proxy has no tenants to keep apart
    start(upstreams, api_keys=KEYS)  # nor a proxy that sends every key as one tenant, on purpose


def test_vllm_0_9_and_later_keeps_tenants_apart_by_cache_salt(fakes):
    arrivals, upstreams = fakes
    for fake in upstreams:
        fake.vllm_version = "0.10.1rc2+cu128"
    with proxy(upstreams, **TENANT) as live:
        for key in KEYS:
            assert post(live, body(), key).status_code == 200
        assert [a.body["cache_salt"] for a in arrivals.seen] == [_salt(k.encode()) for k in KEYS]


def test_an_upstream_not_known_to_keep_tenants_apart_gets_no_request_until_a_probe_learns_it(fakes):
    arrivals, upstreams = fakes
    loading, checked = upstreams
    loading.models_status = 503  # a toolkv still loading its model: whether it trusts the proxy is not known yet
    system = next(s for n in range(64) if home_of(upstreams, s := f"System {n}.", TOOLS, _salt(b"key-a")) is loading)
    with proxy(upstreams, **TENANT) as live:
        assert post(live, body(system)).status_code == 200  # loading's own group, served by the other
        assert arrivals.seen[-1].upstream == checked.name
        health = httpx.get(live.base_url + "/health", timeout=30).json()
        assert [u["tenants_apart"] for u in health["upstreams"]] == [False, True]
        loading.models_status = 200
        health = httpx.get(live.base_url + "/health", timeout=30).json()  # the probe checks it again
        assert [u["tenants_apart"] for u in health["upstreams"]] == [True, True]
        assert post(live, body(system)).status_code == 200
        assert arrivals.seen[-1].upstream == loading.name


def test_no_upstream_known_to_keep_tenants_apart_is_a_503(fakes):
    arrivals, upstreams = fakes
    for fake in upstreams:
        fake.models_status = 503
    with proxy(upstreams, **TENANT) as live:
        resp = post(live, body())
        assert resp.status_code == 503 and "keep tenants apart" in resp.json()["error"]["message"]
        assert not arrivals.seen


def test_an_upstream_that_stops_trusting_the_proxy_gets_no_more_requests(fakes):
    arrivals, upstreams = fakes
    distrustful, other = upstreams
    system = next(s for n in range(64)
                  if home_of(upstreams, s := f"System {n}.", TOOLS, _salt(b"key-a")) is distrustful)
    with proxy(upstreams, **TENANT) as live:
        assert post(live, body(system)).status_code == 200
        assert arrivals.seen[-1].upstream == distrustful.name
        # restarted without the proxy's key in trusted_proxy_keys: it refuses the tenant header
        distrustful.status, distrustful.error_code, distrustful.models_status = 403, "tenant_not_trusted", 403
        refused = post(live, body(system))
        assert refused.status_code == 502
        assert "no longer takes this proxy's tenants" in refused.json()["error"]["message"]
        assert post(live, body(system)).status_code == 200
        assert arrivals.seen[-1].upstream == other.name
        health = httpx.get(live.base_url + "/health", timeout=30).json()  # checked again: still refused
        assert [u["tenants_apart"] for u in health["upstreams"]] == [False, True]
