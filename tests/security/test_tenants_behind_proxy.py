"""Tenants behind a proxy (issue 25, item 1): a real toolkv proxy with two client keys and
`upstream_cache_salt = "tenant"` in front of a real toolkv that lists the proxy's key in
`trusted_proxy_keys`. The upstream keeps the proxy's tenants apart (one tenant's `cached_tokens`
confirm nothing about another's system prompt, tools or conversation), a direct client's
`cache_salt` or tenant header reaches nobody's namespace, and a proxy refuses to start in tenant
mode against an upstream that would serve its tenants from one cache."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.api.app import create_app
from gateway.edge.admission import _salt
from gateway.proxy.app import create_proxy_app
from gateway.proxy.tenancy import TenantsNotKeptApart
from gateway.settings import load_settings
from tests.proxy.conftest import Running, running

PROXY_KEY = "proxy-key-for-the-upstream"
DIRECT_KEY = "a-direct-client-of-the-upstream"
KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
SYSTEM = "You are the assistant of Acme Corp's treasury desk. Never reveal the vault schedule."


@pytest.fixture(scope="module")
def upstream(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    settings = load_settings(overrides={
        "model": str(tiny_model_dir("llama")), "min_prefix_tokens": 8, "served_model_name": "tiny",
        "api_keys": (DIRECT_KEY,), "trusted_proxy_keys": (PROXY_KEY,),
        "cache_dir": str(tmp_path_factory.mktemp("upstream-cache"))}, environ={})
    with running(create_app(settings)) as live:
        yield live


@pytest.fixture(scope="module")
def proxied(upstream: Running) -> Iterator[Running]:
    with running(create_proxy_app(proxy_settings(upstream, PROXY_KEY))) as live:
        yield live


def proxy_settings(upstream: Running, upstream_key: str | None) -> Any:
    return load_settings(overrides={"upstreams": (upstream.base_url,), "upstream_probe_s": 0,
                                    "api_keys": (KEY_A, KEY_B), "upstream_api_key": upstream_key,
                                    "upstream_cache_salt": "tenant"}, environ={})


def body(tools: list[dict[str, Any]], *turns: str, system: str = SYSTEM, **extra: Any) -> dict[str, Any]:
    roles = ["user", "assistant"]
    messages = [{"role": "system", "content": system}]
    messages += [{"role": roles[n % 2], "content": text} for n, text in enumerate(turns)]
    return {"model": "tiny", "messages": messages, "tools": tools, "tool_choice": "none", "temperature": 0,
            "max_tokens": 2, **extra}


def cached(live: Running, payload: dict[str, Any], key: str, headers: dict[str, str] | None = None) -> int:
    resp = httpx.post(live.api_url + "/chat/completions", json=payload, timeout=120,
                      headers={"authorization": f"Bearer {key}", **(headers or {})})
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_tenant_b_never_hits_tenant_as_system_prompt_and_tools_through_the_proxy(proxied, merchant_tools):
    tools = merchant_tools[:5]
    assert cached(proxied, body(tools, "What is our GMV?"), KEY_A) == 0
    assert cached(proxied, body(tools, "And the refunds?"), KEY_A) > 0  # A's own entry: a hit
    assert cached(proxied, body(tools, "What is our GMV?"), KEY_B) == 0  # A's exact prompt: nothing to B
    assert cached(proxied, body(tools, "Refunds?"), KEY_B) > 0  # B's own entry works as A's does


def test_tenant_b_cannot_confirm_tenant_as_conversation_through_the_proxy(proxied, merchant_tools):
    tools = merchant_tools[20:23]
    secret = ["My vault PIN is 4921, remember it.", "Noted.", "What is my PIN?"]
    assert cached(proxied, body(tools, *secret), KEY_A) == 0
    a_again = cached(proxied, body(tools, *secret[:2], "Say my PIN again."), KEY_A)
    assert cached(proxied, body(tools, "Warm-up of my own.", "Sure.", "Hi."), KEY_B) == 0  # B's group entry
    right = cached(proxied, body(tools, *secret[:2], "Say my PIN again."), KEY_B)
    wrong = cached(proxied, body(tools, "My vault PIN is 1111, remember it.", "Noted.", "Say my PIN again."), KEY_B)
    assert right == wrong  # a right guess of A's conversation hits no more than a wrong one
    assert a_again > right  # while A's own conversation record serves A


def test_a_direct_clients_cache_salt_or_tenant_header_reaches_no_one_elses_namespace(upstream, proxied,
                                                                                      merchant_tools):
    tools = merchant_tools[40:44]
    assert cached(proxied, body(tools, "Balance?"), KEY_A) == 0
    assert cached(proxied, body(tools, "Balance now?"), KEY_A) > 0
    # the salt the proxy sends for A (body) and names A by (header), tried directly on the upstream
    salted = body(tools, "Balance?", cache_salt=_salt(KEY_A.encode()))
    assert cached(upstream, salted, DIRECT_KEY) == 0  # ignored: the direct key's own namespace
    for key in (DIRECT_KEY, "not-a-key"):
        named = httpx.post(upstream.api_url + "/chat/completions", json=body(tools, "Balance?"), timeout=60,
                           headers={"authorization": f"Bearer {key}", "x-toolkv-tenant": _salt(KEY_A.encode())})
        expected = (403, "tenant_not_trusted") if key == DIRECT_KEY else (401, "invalid_api_key")
        assert (named.status_code, named.json()["error"]["code"]) == expected
    # the proxy's key itself, without a tenant, is a tenant of its own, not A
    assert cached(upstream, body(tools, "Balance?"), PROXY_KEY) == 0
    # and the proxy, a toolkv too, refuses a tenant its own client names (it names its tenants itself)
    named = httpx.post(proxied.api_url + "/chat/completions", json=body(tools, "Balance?"), timeout=60,
                       headers={"authorization": f"Bearer {KEY_B}", "x-toolkv-tenant": _salt(KEY_A.encode())})
    assert named.status_code == 403 and named.json()["error"]["code"] == "tenant_not_trusted"
    assert cached(proxied, body(tools, "Balance?"), KEY_B) == 0


def test_a_tenants_stored_responses_live_in_its_namespace_on_the_upstream(upstream, proxied):
    client_a = openai.OpenAI(base_url=proxied.api_url, api_key=KEY_A, max_retries=0, timeout=120)
    opening = client_a.responses.create(model="tiny", instructions="You keep notes.", input="Remember: blue.",
                                        max_output_tokens=2, temperature=0)
    follow_up = client_a.responses.create(model="tiny", input="The colour?", previous_response_id=opening.id,
                                          max_output_tokens=2, temperature=0)
    assert client_a.responses.retrieve(follow_up.id).id == follow_up.id  # asked of the upstream as A
    for key in (PROXY_KEY, DIRECT_KEY):  # on the upstream it is A's alone, not the proxy key's
        resp = httpx.get(f"{upstream.api_url}/responses/{opening.id}", timeout=30,
                         headers={"authorization": f"Bearer {key}"})
        assert resp.status_code == 404


def test_the_upstream_says_it_takes_the_tenant_header(upstream):
    assert httpx.get(upstream.base_url + "/version", timeout=30).json()["tenant_salt"] is True


@pytest.mark.parametrize("upstream_key", [DIRECT_KEY, None])
def test_a_proxy_refuses_to_start_in_tenant_mode_against_an_upstream_that_does_not_trust_it(upstream, upstream_key):
    app = create_proxy_app(proxy_settings(upstream, upstream_key))

    async def start() -> None:
        async with app.router.lifespan_context(app):
            pass

    with pytest.raises(TenantsNotKeptApart, match="trusted_proxy_keys"):
        asyncio.run(start())
