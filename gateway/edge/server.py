"""The uvicorn server toolkv runs under, with the one defence uvicorn lacks: a header read timeout;
and its shutdown grace period, with the answer to a request it cuts off.

uvicorn closes idle keep-alive connections, and the body is bounded in time by the app
(`gateway.edge.limits.BodySizeLimit`), but a client that connects and then sends its request line and
headers a byte at a time holds a connection (and its buffers) for as long as it likes
("slowloris"). `HeaderTimeoutProtocol` closes a connection whose headers are not complete within
`header_read_timeout_s` of the connection opening, or of the first byte of the next request on a
kept-alive connection.

When the shutdown grace period runs out, uvicorn cancels a request's task and, when no response
has started, writes a text/plain 500 of its own. `CutOffAnswer`, the outermost middleware, answers
first: a 503 in the OpenAI error envelope (`code: "shutting_down"`, with `Retry-After`), so a
client sees an error it can read and retry elsewhere. The cancellation still runs through the app
below it, so the job is aborted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.edge.limits import envelope_for
from gateway.errors import ShuttingDown, send_error
from gateway.settings import Settings

log = logging.getLogger(__name__)


class HeaderTimeoutProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer: asyncio.TimerHandle | None = self.loop.call_later(
            self.header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def protocol_class(settings: Settings) -> type[HeaderTimeoutProtocol]:
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,),
                {"header_timeout_s": settings.header_read_timeout_s})


class GraceServer(uvicorn.Server):
    """uvicorn's server, with a hook at the end of the shutdown grace period: `at_grace_end` runs
    `grace_s` after the first exit signal, on the event loop. toolkv ends the generations still
    running there, so each client gets its API's `shutting_down` error (in a stream: an error
    event, then its end) before sse-starlette (at grace + 2 s) and uvicorn (grace + 5 s) cancel
    what is left, which cuts a stream off mid-way."""

    def __init__(self, config: uvicorn.Config, grace_s: float, at_grace_end: Callable[[], None]) -> None:
        super().__init__(config)
        self._grace_s = grace_s
        self._at_grace_end = at_grace_end
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first and self._loop is not None:  # a signal handler: hand the timer to the loop
            self._loop.call_soon_threadsafe(self._loop.call_later, self._grace_s, self._at_grace_end)


def server_config(app: Any, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """uvicorn's config for `app`: host and port from settings, the header timeout protocol."""
    options: dict[str, Any] = {"host": settings.host, "port": settings.port, "http": protocol_class(settings),
                               "lifespan": "on", "log_level": settings.log_level, "access_log": False,
                               "timeout_graceful_shutdown": int(settings.shutdown_grace_s) + 5}
    options.update(overrides)
    return uvicorn.Config(app, **options)


class CutOffAnswer:
    """Answers a request cancelled before its response started (uvicorn's graceful-shutdown
    timeout) with `ShuttingDown`; one whose response has started ends as uvicorn ends it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except asyncio.CancelledError:
            if started:
                raise
            log.warning("request cut off by shutdown", extra={"toolkv": {"path": scope.get("path")}})
            cut = ShuttingDown("the server shut down before this request finished (its shutdown grace period "
                               "ran out); retry it", headers={"Retry-After": "1"})
            await send_error(send, cut, body=envelope_for(scope.get("path", ""), cut))
