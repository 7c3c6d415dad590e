"""Real servers on 127.0.0.1 for unchanged third-party clients: a scripted tiny model (exact replies,
for the wire format) and the real default model (for forced and structured requests). Every chat
response and chunk either sends is checked against OpenAI's strict schemas (`spec_wire`); a
violation fails the test that was running when it went out."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from gateway.api.app import create_app
from gateway.settings import load_settings
from tests.clients.scenario import MODEL
from tests.clients.spec_wire import SpecWire, WireLog
from tests.support.family_models import scripted_runtime
from tests.support.models import DefaultModelCopy
from tests.support.server import LiveServer, serve_app

REAL_TIMEOUT_S = 300.0
SCHEMA_VIOLATIONS = "responses or chunks that break OpenAI's strict schema:\n"


@pytest.fixture(scope="session")
def wire_log() -> WireLog:
    return WireLog()


@pytest.fixture(autouse=True)
def wire(wire_log: WireLog) -> WireLog:
    """The session's wire log; its new violations are checked after each test (see the hook below)."""
    return wire_log


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    log = getattr(item, "funcargs", {}).get("wire")
    try:
        result = yield
    except BaseException as failure:
        if isinstance(log, WireLog) and (violations := log.take_violations()):
            failure.add_note(SCHEMA_VIOLATIONS + "\n".join(violations))
        raise
    if isinstance(log, WireLog):
        violations = log.take_violations()
        assert not violations, SCHEMA_VIOLATIONS + "\n".join(violations)
    return result


@pytest.fixture(scope="session")
def scripted_server(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory,
                    wire_log: WireLog) -> Iterator[LiveServer]:
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "served_model_name": MODEL,
                                        "min_prefix_tokens": 8, "disk_budget_bytes": 0,
                                        "cache_dir": str(tmp_path_factory.mktemp("cache"))}, environ={})
    app = create_app(settings, scripted_runtime)
    app.add_middleware(SpecWire, log=wire_log)
    with serve_app(app) as server:
        yield server


@pytest.fixture(scope="package")
def default_server(tmp_path_factory: pytest.TempPathFactory, wire_log: WireLog,
                   default_model_copy: DefaultModelCopy) -> Iterator[LiveServer]:
    """The real default model (SmolLM2-135M-Instruct GGUF), loaded once for all the client tests."""
    cache_dir = default_model_copy.fresh(tmp_path_factory.mktemp("default-cache"))
    settings = load_settings(overrides={"disk_budget_bytes": 0, "cache_dir": str(cache_dir)}, environ={})
    app = create_app(settings)
    app.add_middleware(SpecWire, log=wire_log)
    with serve_app(app) as server:
        yield server


@pytest.fixture
def real_client(default_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=default_server.api_url, api_key="unused", max_retries=0, timeout=REAL_TIMEOUT_S)


@pytest.fixture
def client(scripted_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=scripted_server.api_url, api_key="unused", max_retries=0)
