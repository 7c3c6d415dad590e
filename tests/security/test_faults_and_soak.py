"""A failing generation ends only its own request; a bounded soak of concurrent streams ends
every stream with [DONE], never a 5xx, and memory stays steady."""

from __future__ import annotations

import json
import threading
import time

import httpx
import psutil

HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


class ExplodingModel:
    """Fault injection: the model raises on its first forward, like an OOM or a kernel error."""

    def __init__(self, model):
        self.model = model
        self.config = model.config

    def __call__(self, *args, **kwargs):
        raise RuntimeError("simulated device failure")


def test_exception_in_generation_ends_that_request_only(live):
    runner = live.app.state.gateway.model.runtime.engine.runner  # the one place the engine calls the model
    real = runner.model
    runner.model = ExplodingModel(real)
    try:
        whole = httpx.post(live.api_url + "/chat/completions", json=HI, timeout=60)
        with httpx.stream("POST", live.api_url + "/chat/completions", json=dict(HI, stream=True), timeout=60) as resp:
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    finally:
        runner.model = real
    assert whole.status_code == 500
    assert whole.json()["error"]["code"] == "generation_failed"
    assert "simulated device failure" not in whole.json()["error"]["message"]  # no internals to clients
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(events[-2])["error"]["code"] == "generation_failed"
    assert events[-1] == "[DONE]"
    assert httpx.post(live.api_url + "/chat/completions", json=HI, timeout=60).status_code == 200


def stream_once(live, index: int, results: list) -> None:
    body = {"messages": [{"role": "system", "content": "You answer shop questions." * 10},
                         {"role": "user", "content": f"question {index}"}],
            "max_tokens": 16, "temperature": 0.7, "seed": index, "stream": True}
    with httpx.stream("POST", live.api_url + "/chat/completions", json=body, timeout=120) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        results.append((resp.status_code, lines[-1] if lines else ""))


def test_bounded_soak_of_concurrent_streams(live):
    clients, duration_s = 4, 12.0
    process = psutil.Process()
    results: list = []
    stream_once(live, -1, results)  # warm-up: caches, allocator pools
    rss_before = process.memory_info().rss
    deadline = time.monotonic() + duration_s

    def client(worker: int) -> None:
        count = 0
        while time.monotonic() < deadline and count < 200:
            stream_once(live, worker * 1000 + count, results)
            count += 1

    threads = [threading.Thread(target=client, args=(w,)) for w in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=duration_s + 120)
    growth_mb = (process.memory_info().rss - rss_before) / 1e6
    assert len(results) > clients * 2
    assert all(status == 200 for status, _ in results), {s for s, _ in results}
    assert all(last == "data: [DONE]" for _, last in results)
    assert growth_mb < 200, f"RSS grew {growth_mb:.0f} MB during the soak"
