"""Graceful shutdown: SIGTERM lets requests in flight finish, then the process exits cleanly."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.server import free_port, wait_until_ready
from tests.support.waiting import wait_until

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


@dataclass(frozen=True)
class CutOff:
    answer: httpx.Response  # the non-stream request's
    stream_rest: list[str]  # the stream's `data:` lines after its first
    exit_code: int


def in_flight(base: str) -> float:
    found = re.search(r"^toolkv_requests_in_flight (\S+)$", httpx.get(base + "/metrics").text, re.MULTILINE)
    return float(found[1]) if found else 0.0


@pytest.fixture(scope="module")
def cut_off(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> CutOff:
    """One server (grace period 1 s) with a non-stream request and a stream both still running when
    the grace period ends: one server start for the two tests below, each checking its request."""
    port, work = free_port(), tmp_path_factory.mktemp("cut-off")
    proc = start_server(tiny_model_dir("llama", context=32768), work, port, TOOLKV_SHUTDOWN_GRACE_S="1")
    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_until_ready(base)["status"] == "ok"
        body = {"messages": [{"role": "user", "content": "story"}], "max_tokens": 32000, "temperature": 0,
                "stop": ["\x00never"]}
        answers: list[httpx.Response] = []
        request = threading.Thread(target=lambda: answers.append(
            httpx.post(base + "/v1/chat/completions", json=body, timeout=120)))
        request.start()
        assert wait_until(lambda: in_flight(base) == 1 or not request.is_alive())
        assert request.is_alive(), answers[0].text
        rest = stream_then_sigterm(proc, base, max_tokens=32000)  # SIGTERM with both in flight
        request.join(timeout=60)
        [answer] = answers
        return CutOff(answer, rest, proc.wait(timeout=60))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_request_cut_off_by_shutdown_gets_the_json_error_envelope(cut_off: CutOff) -> None:
    """Past the grace period (uvicorn cancels what is left 5 s later) a running non-stream request
    is answered with a 503 in the OpenAI envelope, not uvicorn's text/plain 500."""
    resp = cut_off.answer
    assert resp.status_code == 503, resp.text
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "shutting_down")
    assert resp.headers["retry-after"] == "1"
    assert cut_off.exit_code in (0, -signal.SIGTERM)


def test_a_stream_still_running_when_the_grace_period_ends_gets_an_error_event_then_its_end(cut_off: CutOff) -> None:
    """Before, sse-starlette cancelled it at the grace's end: the client's stream stopped mid-answer,
    with no error and no [DONE] (curl: a partial transfer), logged as a client that hung up."""
    rest = cut_off.stream_rest
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert (error["type"], error["code"]) == ("server_error", "shutting_down")
    assert cut_off.exit_code in (0, -signal.SIGTERM)
