"""The client side of a relayed stream: a StreamingResponse that also watches for the client
hanging up while the upstream is silent (prefill, a long tool call), so the upstream's stream is
closed, and its generation cancelled, at once rather than at the next event."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Mapping

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class RelayResponse(StreamingResponse):
    def __init__(self, events: AsyncGenerator[bytes, None], headers: Mapping[str, str]) -> None:
        super().__init__(events, headers=headers)
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client left mid-send
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()  # runs the relay's cleanup if a send was interrupted
