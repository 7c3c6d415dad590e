"""Proxy-mode fixtures: real toolkv upstreams on tiny random-weight models (each with its own
cache dir), scripted upstreams that record what reaches them, and the proxy itself, every one a
real uvicorn server on 127.0.0.1 that a test may stop."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI

from adapters.base import ToolGroup, ToolSpec
from gateway.api import dashboard
from gateway.api.app import create_app
from gateway.edge.server import server_config
from gateway.proxy.app import create_proxy_app
from gateway.proxy.fleet.view import upstream_view
from gateway.proxy.routing import AffinityRouter, affinity_key
from gateway.settings import Settings, load_settings
from tests.proxy.fake_upstream import Arrivals, FakeUpstream
from tests.support.server import app_settings, free_port, wait_until_ready
from tests.support.waiting import wait_until

MODEL = "tiny-llama"


@dataclass
class Running:
    app: FastAPI
    base_url: str
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def stop(self) -> None:
        """Shut the server down (its port then refuses connections)."""
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the server did not stop"

    def metrics(self) -> dict[str, float]:
        return scrape(self.base_url)


@contextmanager
def running(app: FastAPI) -> Iterator[Running]:
    port = free_port()
    server = uvicorn.Server(server_config(app, app_settings(app), host="127.0.0.1", port=port,
                                          log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    live = Running(app, f"http://127.0.0.1:{port}", server, thread)
    try:
        assert wait_until(lambda: server.started or not thread.is_alive()) and server.started, "uvicorn did not start"
        assert wait_until_ready(live.base_url)["status"] == "ok"
        yield live
    finally:
        if thread.is_alive():
            live.stop()


def scrape(base_url: str, path: str = "/metrics") -> dict[str, float]:
    """`/metrics` (or `path`) as {'name{labels}': value} (samples only)."""
    text = httpx.get(base_url + path, timeout=30).text
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in samples}


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(value for key, value in samples.items()
               if key.split("{")[0] == name and all(w in key for w in wanted))


@pytest.fixture
def fakes() -> Iterator[tuple[Arrivals, list[Any]]]:
    """Two scripted upstreams, `a` and `b`, recording into one Arrivals."""
    arrivals = Arrivals()
    upstreams = [FakeUpstream(name, arrivals) for name in ("a", "b")]
    with ExitStack() as stack:
        for fake in upstreams:
            fake.base_url = stack.enter_context(running(fake.app)).base_url
        yield arrivals, upstreams
        for fake in upstreams:  # whatever a test left held goes on, so the servers can stop
            if fake.hold is not None:
                fake.hold.set()
            fake.comments_after = None  # and a stream of comments ends


@pytest.fixture(scope="module")
def toolkv_upstreams(tiny_model_dir: Callable[..., Path],
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Running]]:
    """Two toolkv servers on the same tiny model, each with its own cache."""
    with ExitStack() as stack:
        yield [stack.enter_context(running(create_app(upstream_settings(tiny_model_dir, tmp_path_factory))))
               for _ in range(2)]


def upstream_settings(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return load_settings(overrides={"model": str(tiny_model_dir("llama")), "min_prefix_tokens": 8,
                                    "served_model_name": MODEL, "max_queue": 16,
                                    "cache_dir": str(tmp_path_factory.mktemp("upstream-cache"))}, environ={})


@contextmanager
def proxy(upstreams: list[Any], **overrides: Any) -> Iterator[Running]:
    """The proxy as `toolkv serve --upstream` builds it (the fleet view with the dashboard)."""
    settings = load_settings(overrides={"upstreams": tuple(u.base_url for u in upstreams), "upstream_probe_s": 0,
                                        **overrides},
                             environ={})
    with running(create_proxy_app(settings, view=upstream_view(dashboard))) as live:
        yield live


def client_for(live: Running, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=live.api_url, api_key=key, max_retries=0, timeout=120)


def messages(system: str, question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def group_id(system: str | None, tools: list[dict[str, Any]]) -> str:
    """The tool group's id, as the model path and the proxy compute it."""
    specs = [ToolSpec(t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
             for t in tools]
    return ToolGroup.of(system, specs).group_id


def home_of(upstreams: list[Any], system: str | None, tools: list[dict[str, Any]], salt: str = "") -> Any:
    """The upstream the router picks first for this group, none being loaded or down."""
    ranked = AffinityRouter([u.base_url for u in upstreams], 1).ranking(affinity_key(salt, group_id(system, tools)))
    return next(u for u in upstreams if u.base_url == ranked[0])


def tools_of(names_and_sizes: list[tuple[str, int]]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": name, "description": f"{name} " + "words " * size,
                                              "parameters": {"type": "object",
                                                             "properties": {"x": {"type": "string"}}}}}
            for name, size in names_and_sizes]
