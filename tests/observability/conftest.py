"""Fixtures: a real gateway on 127.0.0.1 serving a tiny random-weight model, and one served a known
mix of requests (a miss, a streamed hit, a bypass) whose metrics the tests read back."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from gateway.settings import load_settings
from tests.observability.traffic import BYPASS, Exercised, chat, chat_streamed, openai_client
from tests.support.server import LiveServer, serve


@pytest.fixture(scope="session")
def start_gateway(tiny_model_dir: Callable[..., Path],
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LiveServer]]:
    """start(**settings) -> a new gateway with its own app, metrics and cache dir, serving the tiny
    llama; stopped at session end."""
    with ExitStack() as stack:
        def start(**overrides: Any) -> LiveServer:
            settings = load_settings(overrides={
                "model": str(tiny_model_dir()), "cache_dir": str(tmp_path_factory.mktemp("cache")),
                "min_prefix_tokens": 8, "default_max_tokens": 8, **overrides}, environ={})
            return stack.enter_context(serve(settings))

        yield start


@pytest.fixture(scope="session")
def exercised(start_gateway: Callable[..., LiveServer]) -> Exercised:
    """A gateway that served, on one tool group: a miss, a streamed hit, and a bypass."""
    done = Exercised(start_gateway())
    client = openai_client(done.server)
    done.usages.append(chat(client, "What's the weather in Paris?").usage)
    done.usages.append(chat_streamed(client, "And in Rome?"))
    done.usages.append(chat(client, "And in Oslo?", extra_headers=BYPASS).usage)
    done.streams, done.non_streams = 1, 2
    return done
