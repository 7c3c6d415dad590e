"""The open gateway on a tiny llama model, one per test module that asks for `live` (a module that
needs other settings defines its own `live`)."""

from __future__ import annotations

import pytest

from gateway.settings import load_settings
from tests.support.server import serve


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory):
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "min_prefix_tokens": 8,
                                        "cache_dir": str(tmp_path_factory.mktemp("cache"))}, environ={})
    with serve(settings) as server:
        yield server
