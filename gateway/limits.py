"""Input limits from settings: body size (an ASGI middleware that answers 413 before the body is
parsed), and the size of what a request asks the model to read (tools, schemas, messages)."""

from __future__ import annotations

from itertools import repeat
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import BadRequest, PayloadTooLarge
from gateway.protocol import ChatCompletionRequest
from gateway.settings import Settings


class BodySizeLimit:
    """Reads at most `limit_bytes` of a request body; a larger one gets 413 and is never parsed."""

    def __init__(self, app: ASGIApp, limit_bytes: int) -> None:
        self.app = app
        self.limit_bytes = limit_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit_bytes:
            await self._reject(send)
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit_bytes:
                await self._reject(send)
                return
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _reject(self, send: Send) -> None:
        error = PayloadTooLarge(f"the request body is larger than the limit of {self.limit_bytes} bytes")
        payload = orjson.dumps(error.envelope())
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def check_request_limits(req: ChatCompletionRequest, settings: Settings) -> None:
    if len(req.messages) > settings.max_messages:
        raise BadRequest(f"{len(req.messages)} messages; the limit is {settings.max_messages}", param="messages")
    tools = req.tools or []
    if len(tools) > settings.max_tools:
        raise BadRequest(f"{len(tools)} tools; the limit is {settings.max_tools}", param="tools")
    for index, tool in enumerate(tools):
        params = tool.function.parameters or {}
        size = len(orjson.dumps(tool.model_dump(exclude_none=True)))
        if size > settings.max_tool_schema_bytes:
            raise BadRequest(f"tool '{tool.function.name}' is {size} bytes of JSON; the limit is "
                             f"{settings.max_tool_schema_bytes}", param=f"tools[{index}]")
        if _depth(params, settings.max_schema_depth) > settings.max_schema_depth:
            raise BadRequest(f"the parameters schema of tool '{tool.function.name}' nests deeper than "
                             f"{settings.max_schema_depth} levels", param=f"tools[{index}].function.parameters")


def _depth(value: Any, limit: int) -> int:
    """Nesting depth, walked without recursion (a hostile schema cannot exhaust the stack) and
    given up as soon as it passes `limit`."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                break
        if isinstance(item, dict):
            stack.extend(zip(item.values(), repeat(depth + 1)))
        elif isinstance(item, list):
            stack.extend(zip(item, repeat(depth + 1)))
    return deepest
