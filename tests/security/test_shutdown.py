"""Graceful shutdown: SIGTERM lets requests in flight finish, then the process exits cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.server import free_port, wait_until_ready

REPO = Path(__file__).resolve().parents[2]


def test_sigterm_drains_a_stream_in_flight(tiny_model_dir, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLKV_")}
    env.update(TOOLKV_MODEL=str(tiny_model_dir("llama")), TOOLKV_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_until_ready(base)["status"] == "ok"
        body = {"messages": [{"role": "user", "content": "story"}], "max_tokens": 300, "temperature": 0,
                "stream": True, "stop": ["\x00never"]}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert first.startswith("data: {")
        assert rest[-1] == "data: [DONE]"
        assert any('"finish_reason":"' in line for line in rest)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it drained on
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
