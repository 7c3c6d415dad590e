"""Per-family tiny models and live servers (random-weight or scripted), built once per session."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from gateway.api.app import create_app
from tests.support.family_models import SETUPS, build_family_model, family_settings, scripted_runtime
from tests.support.server import LiveServer, serve_app


@pytest.fixture(scope="session")
def family_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in built:
            built[name] = build_family_model(SETUPS[name], tokenizer_dir, tmp_path_factory.mktemp(f"fam-{name}"))
        return built[name]

    return make


@pytest.fixture(scope="session")
def family_server(family_model_dir: Callable[[str], Path],
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LiveServer]]:
    """family_server(name, scripted=False): a server on 127.0.0.1, started on first use."""
    running: dict[tuple[str, bool], LiveServer] = {}
    with ExitStack() as stack:
        def get(name: str, scripted: bool = False) -> LiveServer:
            if (name, scripted) not in running:
                settings = family_settings(family_model_dir(name), name, tmp_path_factory.mktemp("cache"))
                app = create_app(settings, scripted_runtime) if scripted else create_app(settings)
                running[(name, scripted)] = stack.enter_context(serve_app(app))
            return running[(name, scripted)]

        yield get
