"""One HTTP request run through an ASGI app in this process, its answer handed back as it is sent:
first the status and headers, then each body chunk. This is how an engine replica serves the
ingress: the model app's own routes (validation, error envelopes, streaming, disconnects) run
unchanged, and nothing listens on a port."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

DISCONNECT_GRACE_S = 5.0  # after the caller left: how long the app gets to stop on its own before it is cancelled
RawHeaders = list[tuple[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class ResponseHead:
    status: int
    headers: RawHeaders


async def call_asgi(app: ASGIApp, method: str, path: str, query: bytes, headers: Sequence[tuple[bytes, bytes]],
                    body: bytes) -> AsyncIterator[ResponseHead | bytes]:
    """The app's answer to one request: a `ResponseHead`, then body chunks as the app sends them.
    Closing the iterator early is a client disconnect (the app sees `http.disconnect`)."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    left = asyncio.Event()
    task = asyncio.create_task(_run(app, _scope(method, path, query, headers), _receiver(body, left), sent))
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseHead(message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if chunk := message.get("body", b""):
                    yield chunk
                if not message.get("more_body", False):
                    break
        await task  # raises what the app raised
    finally:
        left.set()
        await _stop(task)


async def _run(app: ASGIApp, scope: dict[str, Any], receive: Any, sent: asyncio.Queue[Message | None]) -> None:
    try:
        await app(scope, receive, sent.put)
    finally:
        sent.put_nowait(None)


def _receiver(body: bytes, left: asyncio.Event) -> Any:
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    return receive


async def _stop(task: asyncio.Task[None]) -> None:
    if not task.done():
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


def _scope(method: str, path: str, query: bytes, headers: Sequence[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
            "root_path": "", "headers": list(headers), "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80),
            "state": {}}
