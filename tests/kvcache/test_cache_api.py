"""The cache management API on a real server (tiny model): warm, list, get, delete, clear, as an
operator and the chat clients after them notice it."""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.settings import load_settings
from tests.support.server import LiveServer, serve

SYSTEM = "You are the back-office assistant of a small web shop. Be brief."
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')} for a customer",
                                      "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                                                     "required": ["order_id"]}}}
    for name in ("get_order", "cancel_order", "refund_order")
]


@pytest.fixture(scope="module")
def live(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "min_prefix_tokens": 8,
                                        "cache_dir": str(tmp_path_factory.mktemp("cache"))}, environ={})
    with serve(settings) as server:
        yield server


@pytest.fixture
def api(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.api_url, timeout=120) as client:
        assert client.delete("/cache").status_code == 200  # each test starts from an empty cache
        yield client


def _chat(api: httpx.Client, tools: list[dict[str, Any]], question: str = "Where is order 42?",
          bypass: bool = False) -> dict[str, Any]:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "tools": tools, "temperature": 0, "max_tokens": 12}
    resp = api.post("/chat/completions", json=body, headers={"X-Toolkv-Cache": "bypass"} if bypass else {})
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


def _cached_tokens(completion: dict[str, Any]) -> int:
    return int(completion["usage"]["prompt_tokens_details"]["cached_tokens"])


def _warm(api: httpx.Client, **body: Any) -> dict[str, Any]:
    resp = api.post("/cache/warm", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


def test_a_warmed_group_is_a_hit_for_the_first_chat_request(api: httpx.Client) -> None:
    warmed = _warm(api, tools=TOOLS, system=SYSTEM)
    assert warmed["already_cached"] is False and warmed["compile_s"] > 0 and warmed["bytes"] > 0
    assert warmed["tool_names"] == ["cancel_order", "refund_order", "get_order"]  # canonical: largest first

    first = _chat(api, list(reversed(TOOLS)))  # the order of the tools does not matter
    assert _cached_tokens(first) == warmed["prefix_tokens"] > 8
    assert first["choices"][0]["message"] == _chat(api, TOOLS, bypass=True)["choices"][0]["message"]
    metrics = httpx.get(api.base_url.join("/metrics")).text
    assert 'toolkv_cache_lookups_total{result="hit",tier="ram"}' in metrics

    again = _warm(api, tools=TOOLS, system=SYSTEM)
    assert again["already_cached"] is True and again["compile_s"] == 0
    assert again["id"] == warmed["id"] and again["prefix_tokens"] == warmed["prefix_tokens"]


def test_warm_writes_the_entry_to_disk_before_answering(api: httpx.Client) -> None:
    warmed = _warm(api, tools=TOOLS[:2], system=SYSTEM)
    listed = api.get(f"/cache/{warmed['id']}").json()
    assert listed["tiers"] == ["ram", "disk"] and listed["tier"] == "ram"
    assert (listed["group_id"], listed["prefix_tokens"]) == (warmed["group_id"], warmed["prefix_tokens"])


def test_listing_shows_each_group_with_its_hits(api: httpx.Client) -> None:
    a = _warm(api, tools=TOOLS, system=SYSTEM)
    b = _warm(api, tools=TOOLS[:1])
    _chat(api, TOOLS)
    listing = api.get("/cache").json()
    assert listing["object"] == "list"
    by_id = {e["id"]: e for e in listing["data"]}
    assert set(by_id) == {a["id"], b["id"]}
    assert by_id[a["id"]]["hits"] == 1 and by_id[b["id"]]["hits"] == 0
    assert listing["data"][0]["id"] == a["id"]  # most recently used first
    assert by_id[b["id"]]["tool_names"] == ["get_order"] and by_id[b["id"]]["bytes"] == b["bytes"]


def test_deleting_an_entry_makes_the_next_request_recompute(api: httpx.Client) -> None:
    warmed = _warm(api, tools=TOOLS, system=SYSTEM)
    deleted = api.delete(f"/cache/{warmed['id']}")
    assert deleted.json() == {"id": warmed["id"], "object": "toolkv.cache_entry.deleted", "deleted": True}
    assert api.get(f"/cache/{warmed['id']}").status_code == 404
    assert _cached_tokens(_chat(api, TOOLS)) == 0  # a miss: computed again
    again = _chat(api, TOOLS)  # the group hits again (the question's turn is one chunk with its generation prompt)
    assert warmed["prefix_tokens"] <= _cached_tokens(again) < again["usage"]["prompt_tokens"]


def test_a_removal_the_disk_refuses_is_an_error_not_a_deletion(api: httpx.Client, live: LiveServer) -> None:
    """On a read-only cache dir, DELETE said `deleted: true` while the file stayed, to be read again
    at the next start. Here the entry's name holds a directory, which no unlink removes."""
    warmed = _warm(api, tools=TOOLS, system=SYSTEM)
    path = live.app.state.gateway.settings.resolved_cache_dir / "kv" / f"{warmed['id']}.safetensors"
    path.unlink()
    path.mkdir()
    try:
        refused = api.delete(f"/cache/{warmed['id']}")
        assert refused.status_code == 500, refused.text
        error = refused.json()["error"]
        assert error["code"] == "cache_files_not_removed" and "could not be removed" in error["message"]
    finally:
        path.rmdir()
    assert api.delete(f"/cache/{warmed['id']}").status_code == 404  # gone from RAM already


def test_a_pin_the_disk_refuses_is_a_507_not_a_pin_lost_at_restart(api: httpx.Client, live: LiveServer) -> None:
    """On a read-only cache dir a pin answered 200 while it lived in memory only: lost at the next
    start, unseen by the other servers on the dir. chattr +i: permissions do not stop root."""
    warmed = _warm(api, tools=TOOLS, system=SYSTEM)
    root = live.app.state.gateway.settings.resolved_cache_dir
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(root)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here")
    try:
        refused = api.post(f"/cache/{warmed['id']}/pin", json={})
        assert refused.status_code == 507, refused.text
        error = refused.json()["error"]
        assert error["code"] == "pin_not_saved" and "cache_dir" in error["message"] and error["param"] == "id"
        assert api.get(f"/cache/{warmed['id']}").json()["pinned"] is False  # nothing changed
    finally:
        subprocess.run(["chattr", "-i", str(root)], check=False)
    assert api.post(f"/cache/{warmed['id']}/pin", json={}).json()["pinned"] is True
    assert api.delete(f"/cache/{warmed['id']}/pin").json()["pinned"] is False


def test_clear_empties_every_tier(api: httpx.Client) -> None:
    _warm(api, tools=TOOLS, system=SYSTEM)
    _warm(api, tools=TOOLS[:1], system=SYSTEM)
    assert api.delete("/cache").json() == {"object": "toolkv.cache.cleared", "deleted": 2}
    assert api.get("/cache").json()["data"] == []
    assert _cached_tokens(_chat(api, TOOLS)) == 0
    assert api.delete("/cache").json()["deleted"] == 1
    assert _cached_tokens(_chat(api, TOOLS)) == 0  # conversation KV went too, not only the groups


def test_routes_change_the_store_on_the_engine_thread_only(api: httpx.Client, live: LiveServer,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine owns the RAM tier and the pool's block counts (kvcache/block_pool.py's `Owner`): a delete, a
    clear and a listing reach them through `engine.call`, never from a route's worker thread."""
    ram = live.app.state.gateway.model.runtime.store.ram
    threads: set[str] = set()

    def spy(name: str) -> None:
        real = getattr(ram, name)

        def recorded(*args: Any) -> Any:
            threads.add(threading.current_thread().name)
            return real(*args)
        monkeypatch.setattr(ram, name, recorded)

    for name in ("remove", "clear", "entries"):
        spy(name)
    warmed = _warm(api, tools=TOOLS, system=SYSTEM)
    assert api.get("/cache").status_code == 200 and api.get("/dashboard/stats").status_code == 200
    assert api.delete(f"/cache/{warmed['id']}").status_code == 200 and api.delete("/cache").status_code == 200
    assert threads == {"toolkv-engine"}


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_unknown_and_malformed_ids(api: httpx.Client, method: str) -> None:
    unknown = api.request(method, "/cache/" + "0" * 64)
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "not_found" and unknown.json()["error"]["param"] == "id"
    for bad in ("tg_123", "A" * 64, "0" * 63, "..%2F..%2Fkv", "%2E%2E", "0" * 64 + "%0A"):
        resp = api.request(method, "/cache/" + bad)
        assert resp.status_code in (400, 404), (bad, resp.text)
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({}, "tools", "nothing to warm"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[3].function.name", "appears twice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name", "at least 1"),
    ({"tools": "get_order"}, "tools", "valid array"),
    ({"tools": TOOLS, "pin": "yes"}, "pin", "valid boolean"),  # strict, as every boolean the API takes
])
def test_warm_rejects_bad_requests_with_a_400_that_says_why(
        api: httpx.Client, body: dict[str, Any], param: str, needle: str) -> None:
    resp = api.post("/cache/warm", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and needle in error["message"]


def test_warm_refuses_a_group_below_the_minimum(api: httpx.Client) -> None:
    resp = api.post("/cache/warm", json={"system": "Hi"})  # a handful of tokens; the minimum is 8
    assert resp.status_code == 400
    assert "min_prefix_tokens (8) are not cached" in resp.json()["error"]["message"]


def test_warm_rejects_a_body_that_is_not_json(api: httpx.Client) -> None:
    resp = api.post("/cache/warm", content=b"{tools: nope", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]


def test_cache_management_needs_the_admin_key(tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "min_prefix_tokens": 8,
                                        "cache_dir": str(tmp_path), "api_keys": ("user-key",),
                                        "admin_key": "admin-key"}, environ={})
    with serve(settings) as server, httpx.Client(base_url=server.api_url, timeout=60) as client:
        calls = [("POST", "/cache/warm"), ("GET", "/cache"), ("GET", "/cache/" + "0" * 64),
                 ("DELETE", "/cache/" + "0" * 64), ("DELETE", "/cache")]
        for method, path in calls:
            assert client.request(method, path, json={"tools": TOOLS}).status_code == 401
            user = client.request(method, path, json={"tools": TOOLS}, headers={"Authorization": "Bearer user-key"})
            assert user.status_code == 403 and user.json()["error"]["code"] == "forbidden"
        admin = client.post("/cache/warm", json={"tools": TOOLS}, headers={"Authorization": "Bearer admin-key"})
        assert admin.status_code == 200 and admin.json()["already_cached"] is False


def test_warming_a_group_larger_than_the_kv_pool_is_refused_at_once(tiny_model_dir: Callable[..., Path],
                                                                     tmp_path: Path) -> None:
    """A group that could never fit would wait forever, evicting every cached group and record on each
    engine step; it is a 400 instead, and the server keeps serving."""
    pool_tokens = 64  # the tiny model: 2 layers x (k, v) x 2 kv heads x 16 dims x 4 bytes per token
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "min_prefix_tokens": 8,
                                        "cache_dir": str(tmp_path), "ram_budget_bytes": pool_tokens * 512},
                             environ={})
    with serve(settings) as server, httpx.Client(base_url=server.api_url, timeout=60) as client:
        resp = client.post("/cache/warm", json={"system": SYSTEM * 4, "tools": TOOLS})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "tools" and "ram_budget_bytes" in error["message"]
        chat = client.post("/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 2})
        assert chat.status_code == 200, chat.text
