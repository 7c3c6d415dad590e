"""The `request-id` header of Anthropic's API, on every answer of the Messages API's paths.

Anthropic's SDKs read it as a response's `request_id` / `_request_id`, and a user quotes it when
something went wrong. Its value is the id toolkv logs the request under: the message's id
(`msg_…`) once the route took the request (gateway/api/messages.py sets it on the request's
state), or a fresh `req_…` for an answer given before that (a wrong key, a body too large, a
shutdown cut-off: every layer inside this one, which is the outermost)."""

from __future__ import annotations

import uuid

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.edge.limits import is_messages_path

REQUEST_ID_HEADER = "request-id"


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


class MessagesRequestId:
    """Adds `request-id` to the response of every Messages API request, errors included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})  # the dict `request.state` reads and writes
        state.setdefault("request_id", new_request_id())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = str(state["request_id"])
            await send(message)

        await self.app(scope, receive, send_with_id)
