"""Input limits from settings: body size and read time (an ASGI middleware that answers 401, 413 or
408 before the body is parsed), nesting depth, and the size of what a request asks the model to
read (tools, schemas, messages).

Nesting is measured without recursion: Python's `json`, jinja's `tojson`, pydantic and orjson all
recurse on nested input, so a hostile document a few hundred levels deep exhausts the stack (a
`RecursionError`, or a C-level recursion limit) inside whatever touches it first. Measuring the
depth with an explicit stack, and refusing what is too deep before anything recursive sees it,
turns that crash into a plain input error."""

from __future__ import annotations

import asyncio
import time
from itertools import repeat
from typing import Any

import orjson
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.edge.admission import KeyRing
from gateway.errors import APIError, BadRequest, PayloadTooLarge, RequestTimeout, send_error
from gateway.protocol.generation import GenerationRequest
from gateway.protocol.messages import error_body as anthropic_error
from gateway.settings import Settings

MESSAGES_PATH = "/v1/messages"  # and what is under it: errors in Anthropic's envelope
MAX_DOCUMENT_DEPTH = 64  # a whole JSON document (a request body, a warm file) nests at most this deep


class BodySizeLimit:
    """Reads at most `limit_bytes` of a request body, within `read_timeout_s`; a larger one gets 413
    and is never parsed, a slower one 408. On `/v1/` routes the API key is checked from the headers
    first: a caller without a valid key gets its 401 before a byte of its body is read."""

    def __init__(self, app: ASGIApp, limit_bytes: int, read_timeout_s: float = 30.0,
                 keyring: KeyRing | None = None) -> None:
        self.app = app
        self.limit_bytes = limit_bytes
        self.read_timeout_s = read_timeout_s
        self.keyring = keyring

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        if self.keyring is not None and scope["path"].startswith("/v1/"):
            try:
                self.keyring.tenant(Request(scope))
            except APIError as exc:
                await _refuse(scope, send, exc)
                return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit_bytes:
            await _refuse(scope, send, self._too_large())
            return
        body, more = bytearray(), True
        deadline = time.monotonic() + self.read_timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                late = RequestTimeout(f"the request body did not arrive within {self.read_timeout_s:g} s")
                await _refuse(scope, send, late)
                return
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit_bytes:
                await _refuse(scope, send, self._too_large())
                return
        await self.app(scope, _replay(bytes(body), receive), send)

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"the request body is larger than the limit of {self.limit_bytes} bytes")


async def _refuse(scope: Scope, send: Send, error: APIError) -> None:
    await send_error(send, error, body=envelope_for(scope["path"], error))


def is_messages_path(path: str) -> bool:
    """The Messages API's paths, whose errors are in Anthropic's envelope."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def envelope_for(path: str, error: APIError) -> dict[str, Any]:
    """`error`'s body: OpenAI's envelope, or on the Messages API's paths Anthropic's."""
    if is_messages_path(path):
        return anthropic_error(error.message, error.status_code, error.param)
    return error.envelope()


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def check_json_depth(data: Any, limit: int = MAX_DOCUMENT_DEPTH, param: str | None = None) -> None:
    """400 for JSON nested deeper than `limit`: walked iteratively, before any recursive
    validator or serializer (pydantic, orjson, json, the chat template) sees it."""
    if nesting_depth(data, limit) > limit:
        where = f"'{param}'" if param else "the request body"
        raise BadRequest(f"{where} nests deeper than {limit} levels", param=param)


def check_arguments_text(text: str, param: str, limit: int = MAX_DOCUMENT_DEPTH) -> None:
    """A tool call's `arguments` is JSON text that the chat template parses again: bound its depth
    (orjson stops at 1,024 levels by itself, with an error that says so)."""
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        if any(word in str(exc).lower() for word in ("depth", "recursion")):  # orjson's own limit
            raise BadRequest(f"'{param}' nests deeper than {limit} levels", param=param) from None
        return  # not JSON: the template writes it as text
    check_json_depth(parsed, limit, param)


def check_request_limits(req: GenerationRequest, settings: Settings) -> None:
    """The request's sizes within the settings' limits; errors name the fields as its client wrote
    them (`req.fields`). A tool's size is its JSON as a chat request's `tools` entry would hold it."""
    names, word = req.fields, req.fields.tool_word
    if len(req.messages) > settings.max_messages:
        raise BadRequest(f"{len(req.messages)} messages; the limit is {settings.max_messages}", param=names.messages)
    if len(req.tools) > settings.max_tools:
        raise BadRequest(f"{len(req.tools)} {word}s; the limit is {settings.max_tools}", param=names.tools)
    for index, tool in enumerate(req.tools):
        if nesting_depth(tool.parameters or {}, settings.max_schema_depth) > settings.max_schema_depth:
            raise BadRequest(f"the parameters schema of {word} '{tool.name}' nests deeper than "
                             f"{settings.max_schema_depth} levels", param=names.tool_parameters.format(index))
        function = {key: value for key, value in (("name", tool.name), ("description", tool.description),
                                                   ("parameters", tool.parameters)) if value is not None}
        size = len(orjson.dumps({"type": "function", "function": function}))
        if size > settings.max_tool_schema_bytes:
            raise BadRequest(f"{word} '{tool.name}' is {size} bytes of JSON; the limit is "
                             f"{settings.max_tool_schema_bytes}", param=names.tool.format(index))
    for m_index, message in enumerate(req.messages):
        for c_index, call in enumerate(message.tool_calls):
            check_arguments_text(call.arguments, names.call_arguments.format(m_index, c_index))


# ---- nesting, walked without recursion ------------------------------------------------------


class TooDeep(ValueError):
    """`where` nests deeper than `limit` levels."""

    def __init__(self, where: str, limit: int) -> None:
        super().__init__(f"{where} nests deeper than {limit} levels")
        self.where = where
        self.limit = limit


def nesting_depth(value: Any, limit: int) -> int:
    """How deep dicts and lists nest in `value` (a scalar is 0, `{}` and `[]` are 1), given up as
    soon as it passes `limit` so a huge document costs no more than its first too-deep branch."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > limit:
            break
        stack.extend(zip(children, repeat(depth + 1)))
    return deepest


def check_nesting(value: Any, limit: int, where: str) -> None:
    """Raise `TooDeep` when `value` nests deeper than `limit` levels."""
    if nesting_depth(value, limit) > limit:
        raise TooDeep(where, limit)
