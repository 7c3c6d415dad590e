"""Keys, tenants and input limits, as a client of a real server meets them."""

from __future__ import annotations

import logging
import threading

import httpx
import pytest

from adapters.base import ToolGroup, ToolSpec
from gateway.settings import load_settings
from tests.support.server import serve
from tests.support.waiting import wait_until

KEYS = ("key-alpha-123", "key-beta-456")
ADMIN = "admin-key-789"
SYSTEM = {"role": "system", "content": "You are a merchant assistant."}


def body(tools, question="GMV?", **extra):
    return {"messages": [SYSTEM, {"role": "user", "content": question}], "tools": tools,
            "tool_choice": "none", "temperature": 0, "max_tokens": 4, **extra}


def group_id(tools) -> str:
    specs = [ToolSpec(t["function"]["name"], t["function"].get("description"), t["function"].get("parameters"))
             for t in tools]
    return ToolGroup.of(SYSTEM["content"], specs).group_id


@pytest.fixture(scope="module")
def secured(tiny_model_dir, tmp_path_factory, merchant_tools):
    settings = load_settings(overrides={
        "model": str(tiny_model_dir("llama")), "min_prefix_tokens": 8, "api_keys": KEYS, "admin_key": ADMIN,
        "cache_dir": str(tmp_path_factory.mktemp("cache")), "max_request_bytes": 64 * 1024, "max_tools": 30,
        "max_schema_depth": 8, "shared_groups": (group_id(merchant_tools[10:13]),)}, environ={})
    with serve(settings) as live:
        yield live


def chat(live, payload, key=None, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(live.api_url + "/chat/completions", json=payload, headers=headers, timeout=60, **kwargs)


def cached(resp) -> int:
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_missing_or_wrong_key_is_401_in_the_envelope(secured, merchant_tools):
    for key in (None, "nope"):
        resp = chat(secured, body(merchant_tools[:2]), key)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(secured.api_url + "/models").status_code == 401
    assert httpx.get(secured.base_url + "/health").json()["status"] == "ok"


def test_tenants_never_hit_each_others_entries(secured, merchant_tools):
    tools = merchant_tools[:4]
    assert cached(chat(secured, body(tools), KEYS[0])) == 0
    assert cached(chat(secured, body(tools, "again"), KEYS[0])) > 0
    assert cached(chat(secured, body(tools, "mine?"), KEYS[1])) == 0  # same tools, other tenant: a miss
    assert cached(chat(secured, body(tools, "mine!"), KEYS[1])) > 0


def test_groups_marked_shared_are_shared_on_purpose(secured, merchant_tools):
    tools = merchant_tools[10:13]
    assert cached(chat(secured, body(tools), KEYS[0])) == 0
    assert cached(chat(secured, body(tools, "shared?"), KEYS[1])) > 0


def test_keys_never_reach_the_logs(secured, merchant_tools, caplog):
    with caplog.at_level(logging.DEBUG):
        chat(secured, body(merchant_tools[:2]), KEYS[0])
        chat(secured, body(merchant_tools[:2]), "wrong-secret-key")
    text = caplog.text
    assert all(secret not in text for secret in (*KEYS, ADMIN, "wrong-secret-key"))


def test_body_over_the_limit_is_413(secured):
    resp = chat(secured, {"messages": [{"role": "user", "content": "x" * 100_000}]}, KEYS[0])
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "request_too_large"


def test_non_utf8_body_is_400(secured):
    resp = httpx.post(secured.api_url + "/chat/completions", content=b'{"messages": "\xff\xfe"}',
                      headers={"Authorization": f"Bearer {KEYS[0]}", "content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"


def test_too_many_tools_and_too_deep_schemas_are_400(secured, merchant_tools):
    many = chat(secured, body(merchant_tools[:31]), KEYS[0])
    assert many.status_code == 400 and many.json()["error"]["param"] == "tools"
    deep: dict = {"type": "object"}
    for _ in range(10):
        deep = {"type": "object", "properties": {"x": deep}}
    tool = {"type": "function", "function": {"name": "deep", "parameters": deep}}
    resp = chat(secured, body([tool]), KEYS[0])
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools[0].function.parameters"


def test_prompt_longer_than_the_context_is_context_length_exceeded(secured):
    words = " ".join(["token"] * 5000)  # tiny model context: 4096
    resp = chat(secured, {"messages": [{"role": "user", "content": words}]}, KEYS[0])
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "context_length_exceeded"


def test_full_queue_answers_429_with_retry_after(tiny_model_dir, tmp_path):
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "max_queue": 1,
                                        "cache_dir": str(tmp_path)}, environ={})
    hi = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with serve(settings) as live:
        engine = live.app.state.gateway.model.runtime.engine
        release, started = threading.Event(), threading.Event()
        blocker = engine.call(lambda: (started.set(), release.wait(60)))  # occupies the engine thread
        assert started.wait(30)
        waiting = threading.Thread(target=chat, args=(live, hi))
        waiting.start()
        assert wait_until(lambda: engine.queue_depth == 1)  # the queue (size 1) is full now
        refused = chat(live, hi)
        assert refused.status_code == 429
        assert refused.headers["retry-after"]
        assert refused.json()["error"]["type"] == "rate_limit_error"
        release.set()
        blocker.result(timeout=30)
        waiting.join(timeout=60)
        assert not waiting.is_alive()
        assert chat(live, hi).status_code == 200
