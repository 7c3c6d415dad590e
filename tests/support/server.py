"""A real uvicorn server on 127.0.0.1 running the gateway app in this process, for HTTP tests."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from gateway.api.app import create_app
from gateway.edge.server import server_config
from gateway.settings import Settings
from tests.support.waiting import wait_until

READY_DEADLINE_S = 300.0


def app_settings(app: FastAPI) -> Settings:
    """The settings an app was built with: a model app's, a proxy's, or a test's own app's `state.settings`."""
    owned = getattr(app.state, "gateway", None) or getattr(app.state, "proxy", None)
    settings: Settings = owned.settings if owned is not None else app.state.settings
    return settings


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LiveServer:
    app: FastAPI
    base_url: str

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"


def wait_until_ready(base_url: str, deadline_s: float = READY_DEADLINE_S) -> dict[str, Any]:
    """Poll /health until the model is loaded (or failed to): its last answer."""
    last: dict[str, Any] = {}

    def settled() -> bool:
        nonlocal last
        try:
            last = poller.get(base_url + "/health").json()
        except (httpx.HTTPError, ValueError):  # not listening yet, or not yet the app (Serve's 404 text)
            last = {}
        return last.get("status") in ("ok", "failed")

    with httpx.Client(timeout=5) as poller:  # one client for every poll: a new one per poll costs CPU the server needs
        if not wait_until(settled, deadline_s, interval_s=0.1):
            raise TimeoutError(f"server at {base_url} not ready: {last}")
    return last


@contextmanager
def serve_app(app: FastAPI, wait_ready: bool = True) -> Iterator[LiveServer]:
    port = free_port()
    server = uvicorn.Server(server_config(app, app_settings(app), host="127.0.0.1", port=port,
                                          log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_started(server)
        if wait_ready:
            status = wait_until_ready(base)
            assert status["status"] == "ok", status
        yield LiveServer(app, base)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def serve(settings: Settings) -> Iterator[LiveServer]:
    with serve_app(create_app(settings)) as live:
        yield live


def _wait_started(server: uvicorn.Server) -> None:
    if not wait_until(lambda: server.started, 30):
        raise TimeoutError("uvicorn did not start")
