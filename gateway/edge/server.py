"""The uvicorn server toolkv runs under, with the one defence uvicorn lacks: a header read timeout.

uvicorn closes idle keep-alive connections, and the body is bounded in time by the app
(`gateway.edge.limits.BodySizeLimit`), but a client that connects and then sends its request line and
headers a byte at a time holds a connection (and its buffers) for as long as it likes
("slowloris"). `HeaderTimeoutProtocol` closes a connection whose headers are not complete within
`header_read_timeout_s` of the connection opening, or of the first byte of the next request on a
kept-alive connection.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.settings import Settings


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


def server_config(app: Any, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """uvicorn's config for `app`: host and port from settings, the header timeout protocol."""
    options: dict[str, Any] = {"host": settings.host, "port": settings.port, "http": protocol_class(settings),
                               "lifespan": "on", "log_level": settings.log_level, "access_log": False,
                               "timeout_graceful_shutdown": int(settings.shutdown_grace_s) + 5}
    options.update(overrides)
    return uvicorn.Config(app, **options)
