"""Loading, concurrency and disconnects, as a client of a real server notices them."""

from __future__ import annotations

import threading

import httpx

from gateway.api.app import create_app
from gateway.serving.runtime import build_runtime
from gateway.settings import load_settings
from tests.support.server import serve_app, wait_until_ready
from tests.support.waiting import wait_until


def test_health_answers_at_once_and_chat_gets_503_while_loading(tiny_model_dir, tmp_path):
    release = threading.Event()

    def slow_factory(settings, metrics):
        release.wait(timeout=120)
        return build_runtime(settings, metrics)

    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "cache_dir": str(tmp_path)},
                             environ={})
    with serve_app(create_app(settings, slow_factory), wait_ready=False) as live:
        assert httpx.get(live.base_url + "/health").json() == {"status": "loading"}
        resp = httpx.post(live.api_url + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 503
        assert resp.headers["retry-after"]
        assert resp.json()["error"]["code"] == "model_loading"
        release.set()
        assert wait_until_ready(live.base_url)["status"] == "ok"
        ok = httpx.post(live.api_url + "/chat/completions",
                        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200


def test_a_ram_budget_that_holds_no_kv_block_fails_the_load_not_every_request(tiny_model_dir, tmp_path):
    """`--ram-budget-bytes 1` said ok on /health, then refused every request for a pool of 0 tokens."""
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "cache_dir": str(tmp_path),
                                        "ram_budget_bytes": 1}, environ={})
    with serve_app(create_app(settings, build_runtime), wait_ready=False) as live:
        health = wait_until_ready(live.base_url)
        assert health["status"] == "failed"
        assert "ram_budget_bytes (1 B) holds no KV block" in str(health)
        resp = httpx.post(live.api_url + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 503


def test_health_says_ok_only_once_the_first_grammars_one_time_work_is_done(live):
    """A first request with tools used to pay llguidance's view of the vocabulary and the closing
    token sets (about a second on the CPU) on top of its own work: the server pays it at start-up,
    and a first tool request compiles only its own grammar."""
    grammars = live.app.state.gateway.model.runtime.service.grammars
    assert grammars.warmed
    compiles = grammars.compiles
    tool = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}
    resp = httpx.post(live.api_url + "/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": "required",
        "max_tokens": 8})
    assert resp.status_code == 200 and grammars.compiles == compiles + 1


def test_event_loop_serves_health_while_a_generation_runs(live):
    body = {"messages": [{"role": "user", "content": "Tell a story"}], "max_tokens": 400, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", live.api_url + "/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert httpx.get(live.base_url + "/health", timeout=5).json()["status"] == "ok"
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"


def test_client_disconnect_stops_its_generation(live):
    engine = live.app.state.gateway.model.runtime.engine
    before = engine.num_cancelled
    body = {"messages": [{"role": "user", "content": "Count forever"}], "max_tokens": 3000, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", live.api_url + "/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))
    assert wait_until(lambda: engine.num_cancelled == before + 1)
    assert not engine.busy or engine.queue_depth == 0
