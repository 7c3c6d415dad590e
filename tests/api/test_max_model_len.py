"""`--max-model-len` (`max_model_len`) caps the context a request may use, below the model's own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from gateway.settings import load_settings
from tests.support.server import serve


def test_max_model_len_caps_prompt_plus_completion(tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "max_model_len": 64,
                                        "disk_budget_bytes": 0, "cache_dir": str(tmp_path)}, environ={})
    with serve(settings) as server, httpx.Client(base_url=server.api_url, timeout=60) as client:
        short = client.post("/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 4})
        assert short.status_code == 200, short.text
        long = client.post("/chat/completions", json={"messages": [{"role": "user", "content": "word " * 80}],
                                                      "max_tokens": 4})
        assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded", long.text
        assert "64 tokens" in long.json()["error"]["message"]
        room = client.post("/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 200})
        assert room.status_code == 400 and room.json()["error"]["param"] == "max_tokens", room.text
