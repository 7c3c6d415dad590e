"""`POST`/`DELETE /v1/cache/{id}/pin` through the proxy, in front of real toolkv servers: the entry is
pinned (and unpinned) on every upstream that holds it, and the answer says which; an upstream
without it, or without toolkv's cache API, is left alone; an unknown id is a 404, a bad one a 400;
an upstream that does not answer is a 503 naming it and where the pin was made; an upstream's
refusal (its pinned_budget_bytes) is passed on naming it; the admin key is checked first."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.api.app import create_app
from gateway.settings import Settings
from tests.proxy.conftest import Running, proxy, running, upstream_settings
from tests.proxy.fake_upstream import Arrivals, FakeUpstream

TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} for the pins desk " * 4,
                                           "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
         for name in ("pin_orders", "pin_refunds")]


def warm(upstream: Running, system: str) -> dict[str, Any]:
    """Warm a group on one upstream directly (as an operator would on each)."""
    resp = httpx.post(upstream.api_url + "/cache/warm", json={"system": system, "tools": TOOLS}, timeout=120)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def pinned_on(upstream: Running, entry_id: str) -> bool | None:
    """Whether the upstream holds the entry pinned (None: it does not hold it)."""
    resp = httpx.get(f"{upstream.api_url}/cache/{entry_id}", timeout=60)
    return None if resp.status_code == 404 else bool(resp.json()["pinned"])


def change(live: Running, method: str, entry_id: str, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {} if method == "POST" else None  # as curl -d '{}' sends it
    return httpx.request(method, f"{live.api_url}/cache/{entry_id}/pin", json=body, headers=headers, timeout=120)


def test_a_pin_is_made_on_every_upstream_holding_the_entry_and_undone_there(toolkv_upstreams):
    first, second = toolkv_upstreams
    entry = warm(first, "You are the pins desk, shared.")
    assert warm(second, "You are the pins desk, shared.")["id"] == entry["id"]  # one model, one id
    with proxy(toolkv_upstreams) as live:
        resp = change(live, "POST", entry["id"])
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["pinned"] is True and body["id"] == entry["id"] and body["tool_names"] == entry["tool_names"]
        assert sorted(body["upstreams"]) == sorted([first.base_url, second.base_url])
        assert pinned_on(first, entry["id"]) is True and pinned_on(second, entry["id"]) is True
        resp = change(live, "DELETE", entry["id"])
        assert resp.status_code == 200 and resp.json()["pinned"] is False
        assert pinned_on(first, entry["id"]) is False and pinned_on(second, entry["id"]) is False


def test_an_upstream_without_the_entry_or_without_a_cache_api_is_left_alone(toolkv_upstreams, fakes):
    first, second = toolkv_upstreams
    _, (vllm_like, _) = fakes
    entry = warm(first, "You are the pins desk, on one upstream.")
    with proxy([first, second, vllm_like]) as live:
        resp = change(live, "POST", entry["id"])
        assert resp.status_code == 200, resp.text
        assert resp.json()["upstreams"] == [first.base_url]
        assert pinned_on(second, entry["id"]) is None
        missing = change(live, "POST", "0" * 64)
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "id"
        bad = change(live, "DELETE", "A" * 64)  # refused before any upstream is asked
        assert bad.status_code == 400 and "not a cache entry id" in bad.json()["error"]["message"]
        assert change(live, "DELETE", entry["id"]).status_code == 200


def test_an_upstream_that_does_not_answer_is_a_503_naming_it(toolkv_upstreams):
    first, second = toolkv_upstreams
    entry = warm(first, "You are the pins desk, with one upstream gone.")
    with running(FakeUpstream("c", Arrivals()).app) as third, proxy([first, second, third]) as live:
        third.stop()  # its port now refuses connections
        gone = third.base_url
        resp = change(live, "POST", entry["id"])
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        message = resp.json()["error"]["message"]
        assert gone in message and f"pinned on: {first.base_url}" in message
        assert pinned_on(first, entry["id"]) is True  # where it could be pinned, it was
        assert change(live, "DELETE", entry["id"]).status_code == 503


def test_an_upstreams_refusal_is_passed_on_naming_it(toolkv_upstreams, tiny_model_dir: Callable[..., Path],
                                                      tmp_path_factory: pytest.TempPathFactory):
    first, _ = toolkv_upstreams
    tight: Settings = upstream_settings(tiny_model_dir, tmp_path_factory).model_copy(
        update={"pinned_budget_bytes": 0})
    with ExitStack() as stack:
        no_pins = stack.enter_context(running(create_app(tight)))
        entry = warm(first, "You are the pins desk, refused.")
        assert warm(no_pins, "You are the pins desk, refused.")["id"] == entry["id"]
        live = stack.enter_context(proxy([first, no_pins]))
        resp = change(live, "POST", entry["id"])
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["code"] == "pinned_budget_exceeded" and "pinned_budget_bytes" in error["message"]
        assert error["message"].startswith(no_pins.base_url) and f"done on: {first.base_url}" in error["message"]
        assert change(live, "DELETE", entry["id"]).json()["upstreams"] == [first.base_url, no_pins.base_url]


def test_pinning_through_a_proxy_with_keys_needs_its_admin_key(toolkv_upstreams):
    first, _ = toolkv_upstreams
    entry = warm(first, "You are the pins desk, keyed.")
    with proxy(toolkv_upstreams, api_keys=("client-key",), admin_key="admin-key") as live:
        assert change(live, "POST", entry["id"]).status_code == 401
        assert change(live, "POST", entry["id"], "client-key").status_code == 403
        resp = change(live, "POST", entry["id"], "admin-key")
        assert resp.status_code == 200 and resp.json()["upstreams"] == [first.base_url]
        assert change(live, "DELETE", entry["id"], "admin-key").status_code == 200
