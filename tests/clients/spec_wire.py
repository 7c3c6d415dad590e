"""Every chat completion body and stream chunk a test server sends, checked against OpenAI's strict
schemas on the wire, whichever client (Python, LangChain, pydantic-ai, the agents SDK, Node) asked.

`SpecWire` is an ASGI middleware put around the gateway app by the test fixtures; it records each
exchange before passing its bytes on, so a client never sees a response the log has not checked."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator

from tests.conftest import STRICT_SPEC

CHAT_PATH = "/v1/chat/completions"
WATCHED_PATHS = (CHAT_PATH, "/v1/responses", "/v1/completions")

Message = MutableMapping[str, Any]
ASGIApp = Callable[[Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


def strict_validator(def_name: str) -> Draft202012Validator:
    bundle = json.loads(STRICT_SPEC.read_text())
    return Draft202012Validator({"$schema": bundle["$schema"], "$defs": bundle["$defs"], "$ref": f"#/$defs/{def_name}"})


@dataclass
class Exchange:
    """One response as it went out: its JSON body, or its stream events in order."""

    path: str
    request: Any = None  # the request's JSON body
    status: int = 0
    streamed: bool = False
    body: Any = None
    chunks: list[Any] = field(default_factory=list)
    done: bool = False  # a stream's `data: [DONE]` arrived
    _raw: bytearray = field(default_factory=bytearray)
    _request_raw: bytearray = field(default_factory=bytearray)


class WireLog:
    """The exchanges every server of the session sent, and the schema violations found in them."""

    def __init__(self) -> None:
        self.exchanges: list[Exchange] = []
        self.violations: list[str] = []
        self._reported = 0
        self._response = strict_validator("CreateChatCompletionResponse")
        self._chunk = strict_validator("CreateChatCompletionStreamResponse")
        self._error = strict_validator("ErrorResponse")

    def take_violations(self) -> list[str]:
        """Violations found since the last call."""
        new = self.violations[self._reported:]
        self._reported = len(self.violations)
        return new

    def since(self, mark: int, path: str = CHAT_PATH) -> list[Exchange]:
        return [e for e in self.exchanges[mark:] if e.path == path]

    def check_body(self, exchange: Exchange) -> None:
        if exchange.status >= 400:
            self._check(self._error, exchange, exchange.body, "error body")
        elif exchange.path == CHAT_PATH:
            self._check(self._response, exchange, exchange.body, "response")

    def check_chunk(self, exchange: Exchange, chunk: Any) -> None:
        if exchange.path == CHAT_PATH:
            self._check(self._chunk, exchange, chunk, f"chunk {len(exchange.chunks) - 1}")

    def _check(self, validator: Draft202012Validator, exchange: Exchange, instance: Any, what: str) -> None:
        for error in validator.iter_errors(instance):
            where = "/".join(str(p) for p in error.absolute_path)
            self.violations.append(f"{exchange.path} {what} at /{where}: {error.message[:300]}")


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


class SpecWire:
    """ASGI middleware feeding a `WireLog` with what the app sends on the watched paths."""

    def __init__(self, app: ASGIApp, log: WireLog) -> None:
        self.app, self.log = app, log

    async def __call__(self, scope: Message, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http" or scope["path"] not in WATCHED_PATHS:
            await self.app(scope, receive, send)
            return
        exchange = Exchange(scope["path"])
        self.log.exchanges.append(exchange)

        async def recording_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                exchange._request_raw += message.get("body", b"")
                if not message.get("more_body", False):
                    exchange.request = _json_or_none(bytes(exchange._request_raw))
            return message

        async def recording_send(message: Message) -> None:
            self._record(exchange, message)
            await send(message)

        await self.app(scope, recording_receive, recording_send)

    def _record(self, exchange: Exchange, message: Message) -> None:
        if message["type"] == "http.response.start":
            exchange.status = message["status"]
            headers = {k.lower(): v for k, v in message.get("headers", [])}
            exchange.streamed = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body":
            exchange._raw += message.get("body", b"")
            if exchange.streamed:
                self._take_events(exchange)
                if not message.get("more_body", False) and exchange.path == CHAT_PATH and not exchange.done:
                    self.log.violations.append(f"{exchange.path} stream ended without data: [DONE]")
            elif not message.get("more_body", False):
                self._take_body(exchange)

    def _take_body(self, exchange: Exchange) -> None:
        try:
            exchange.body = json.loads(bytes(exchange._raw))
        except ValueError:
            self.log.violations.append(f"{exchange.path} body is not JSON: {bytes(exchange._raw)[:200]!r}")
            return
        self.log.check_body(exchange)

    def _take_events(self, exchange: Exchange) -> None:
        text = bytes(exchange._raw).replace(b"\r\n", b"\n")
        *events, rest = text.split(b"\n\n")
        exchange._raw = bytearray(rest)
        for event in events:
            data = "\n".join(line[5:].removeprefix(" ") for line in event.decode().split("\n")
                             if line.startswith("data:"))
            if data == "[DONE]":
                exchange.done = True
            elif data:
                self._take_chunk(exchange, data)

    def _take_chunk(self, exchange: Exchange, data: str) -> None:
        try:
            exchange.chunks.append(json.loads(data))
        except ValueError:
            self.log.violations.append(f"{exchange.path} stream event is not JSON: {data[:200]!r}")
            return
        self.log.check_chunk(exchange, exchange.chunks[-1])
