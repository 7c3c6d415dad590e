"""Graceful shutdown: SIGTERM lets requests in flight finish, then the process exits cleanly."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from tests.support.server import free_port, wait_until_ready

REPO = Path(__file__).resolve().parents[2]


def start_server(model: Path, tmp_path: Path, port: int, **settings: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLKV_")}
    env.update(TOOLKV_MODEL=str(model), TOOLKV_CACHE_DIR=str(tmp_path / "cache"), **settings)
    return subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stream_then_sigterm(proc: subprocess.Popen[bytes], base: str, max_tokens: int) -> list[str]:
    """Stream a greedy answer, send SIGTERM once its first chunk is in, and read the rest: the
    `data:` lines after the first."""
    body = {"messages": [{"role": "user", "content": "story"}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stop": ["\x00never"]}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert first.startswith("data: {")
        proc.send_signal(signal.SIGTERM)
        return [line for line in lines if line.startswith("data: ")]


def test_sigterm_drains_a_stream_in_flight(tiny_model_dir, tmp_path):
    port = free_port()
    proc = start_server(tiny_model_dir("llama"), tmp_path, port)
    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_until_ready(base)["status"] == "ok"
        rest = stream_then_sigterm(proc, base, max_tokens=300)
        assert rest[-1] == "data: [DONE]"
        assert any('"finish_reason":"' in line for line in rest)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it drained on
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_request_cut_off_by_shutdown_gets_the_json_error_envelope(tiny_model_dir, tmp_path):
    """Past the grace period (0 s here; uvicorn cancels what is left 5 s later) a running
    non-stream request is answered with a 503 in the OpenAI envelope, not uvicorn's text/plain 500."""
    port = free_port()
    proc = start_server(tiny_model_dir("llama", context=32768), tmp_path, port, TOOLKV_SHUTDOWN_GRACE_S="0")
    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_until_ready(base)["status"] == "ok"
        body = {"messages": [{"role": "user", "content": "story"}], "max_tokens": 32000, "temperature": 0,
                "stop": ["\x00never"]}
        answers: list[httpx.Response] = []
        request = threading.Thread(target=lambda: answers.append(
            httpx.post(base + "/v1/chat/completions", json=body, timeout=120)))
        request.start()
        while not re.search(r"^toolkv_requests_in_flight 1\.0$", httpx.get(base + "/metrics").text, re.MULTILINE):
            assert request.is_alive(), answers[0].text
        proc.send_signal(signal.SIGTERM)
        request.join(timeout=60)
        [resp] = answers
        assert resp.status_code == 503, resp.text
        assert resp.headers["content-type"] == "application/json"
        error = resp.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "shutting_down")
        assert resp.headers["retry-after"] == "1"
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stream_still_running_when_the_grace_period_ends_gets_an_error_event_then_its_end(tiny_model_dir,
                                                                                            tmp_path):
    """Before, sse-starlette cancelled it at the grace's end: the client's stream stopped mid-answer,
    with no error and no [DONE] (curl: a partial transfer), logged as a client that hung up."""
    port = free_port()
    proc = start_server(tiny_model_dir("llama", context=32768), tmp_path, port, TOOLKV_SHUTDOWN_GRACE_S="1")
    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_until_ready(base)["status"] == "ok"
        rest = stream_then_sigterm(proc, base, max_tokens=32000)
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert (error["type"], error["code"]) == ("server_error", "shutting_down")
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
