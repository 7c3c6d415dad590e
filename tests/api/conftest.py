from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from gateway.settings import load_settings
from tests.support.server import LiveServer, serve


@pytest.fixture(scope="module")
def live(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "min_prefix_tokens": 8,
                                        "served_model_name": "tiny-llama", "max_queue": 8,
                                        "cache_dir": str(tmp_path_factory.mktemp("cache"))}, environ={})
    with serve(settings) as server:
        yield server


RESPONSES_KEYS = ("key-alpha-123", "key-beta-456")


@pytest.fixture(scope="module")
def secured(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server with two API keys (RESPONSES_KEYS), keeping 2 Responses per key."""
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "served_model_name": "tiny-llama",
                                        "min_prefix_tokens": 8, "api_keys": RESPONSES_KEYS, "max_stored_responses": 2,
                                        "cache_dir": str(tmp_path_factory.mktemp("cache"))}, environ={})
    with serve(settings) as server:
        yield server


@pytest.fixture
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.api_url, api_key="unused", max_retries=0)
