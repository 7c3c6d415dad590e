"""A scripted tiny model behind a real server on 127.0.0.1, for unchanged third-party clients."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from gateway.app import create_app
from gateway.settings import load_settings
from tests.clients.scenario import MODEL
from tests.support.server import LiveServer, serve_app
from tests.tools.models import scripted_runtime


@pytest.fixture(scope="session")
def scripted_server(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[LiveServer]:
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "served_model_name": MODEL,
                                        "min_prefix_tokens": 8, "disk_budget_bytes": 0,
                                        "cache_dir": str(tmp_path_factory.mktemp("cache"))}, environ={})
    with serve_app(create_app(settings, scripted_runtime)) as server:
        yield server


@pytest.fixture
def client(scripted_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=scripted_server.api_url, api_key="unused", max_retries=0)
