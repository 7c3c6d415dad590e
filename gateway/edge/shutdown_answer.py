"""The answer to a request still running when the shutdown grace period runs out.

uvicorn then cancels the request's task and, when no response has started, writes a text/plain
500 of its own. `CutOffAnswer`, the outermost middleware, answers first: a 503 in the OpenAI error
envelope (`code: "shutting_down"`, with `Retry-After`), so a client sees an error it can read and
retry elsewhere. The cancellation still runs through the app below it, so the job is aborted."""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.edge.limits import envelope_for
from gateway.errors import ShuttingDown, send_error

log = logging.getLogger(__name__)


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
