"""Reading an upstream's answer without changing it: server-sent events cut into whole events as
the bytes arrive (each forwarded as it was received), and the usage an answer or a stream's
final event reports."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.proxy.metrics import Usage
from gateway.proxy.shaping import Kind

MAX_EVENT_BYTES = 8 * 1024**2  # an upstream that sends more without ending an event is broken
_ENDINGS = (b"\n\n", b"\r\n\r\n")
_LONGEST_ENDING = max(len(ending) for ending in _ENDINGS)
_USAGE_MARK = b'"usage"'


class StreamBroken(Exception):
    """The upstream's stream is not server-sent events."""


class EventSplitter:
    """Cuts an SSE byte stream into events, each with its blank line, byte for byte as received.
    At most `max_event_bytes` are held for an unfinished event, and each byte is searched for an
    event's end once (an event arriving in many small pieces costs no more than one arriving whole)."""

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self._buffer = bytearray()
        self._searched = 0  # the buffer's bytes before this hold no event end starting there

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        events: list[bytes] = []
        start = 0
        while (end := self._event_end(start)) is not None:
            events.append(bytes(self._buffer[start:end]))
            start = self._searched = end
        del self._buffer[:start]
        self._searched = max(0, len(self._buffer) - _LONGEST_ENDING + 1)
        if len(self._buffer) > self.max_event_bytes:
            raise StreamBroken(f"the upstream sent {len(self._buffer)} bytes without ending an event "
                               f"(the limit is {self.max_event_bytes})")
        return events

    def rest(self) -> bytes:
        """What came after the last whole event (sent on as it is when the stream ends)."""
        rest = bytes(self._buffer)
        self._buffer.clear()
        self._searched = 0
        return rest

    def _event_end(self, start: int) -> int | None:
        since = max(start, self._searched)
        ends = [at + len(ending) for ending in _ENDINGS if (at := self._buffer.find(ending, since)) >= 0]
        return min(ends) if ends else None


def has_data(event: bytes) -> bool:
    """False for an event of comments alone (`: ping`)."""
    return any(line.startswith(b"data:") for line in event.replace(b"\r\n", b"\n").split(b"\n"))


def event_data(event: bytes) -> bytes:
    """The event's `data:` lines, joined as SSE joins them."""
    lines = event.replace(b"\r\n", b"\n").split(b"\n")
    data = [line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:")]
    return b"\n".join(data)


# The events that end each API's stream; an upstream that closes its stream before one of them
# (a close-delimited answer cut off looks like a clean end to HTTP) broke it off.
_LAST_EVENTS: dict[Kind, frozenset[str]] = {
    "responses": frozenset({"response.completed", "response.failed", "response.incomplete", "error"}),
    "messages": frozenset({"message_stop", "error"}),
}


def ends_stream(kind: Kind, event: bytes) -> bool:
    """Whether `event` is the last one its API sends: `data: [DONE]` (chat, completions), the
    response's final state or an error (Responses), `message_stop` or an error (Messages)."""
    last = _LAST_EVENTS.get(kind)
    if last is None:
        return b"[DONE]" in event and event_data(event).strip() == b"[DONE]"
    if not any(name.encode() in event for name in last):  # most events: no parse
        return False
    try:
        data = orjson.loads(event_data(event))
    except orjson.JSONDecodeError:
        return False
    return isinstance(data, dict) and data.get("type") in last


def event_usage(kind: Kind, event: bytes) -> tuple[Usage | None, bool]:
    """The usage an event reports, and whether the event carries nothing else (OpenAI's final
    `include_usage` chunk, whose `choices` is empty)."""
    if _USAGE_MARK not in event:
        return None, False
    try:
        chunk = orjson.loads(event_data(event))
    except orjson.JSONDecodeError:
        return None, False
    if not isinstance(chunk, dict):
        return None, False
    usage = body_usage(kind, chunk)
    return usage, usage is not None and kind != "responses" and chunk.get("choices") == []


def body_usage(kind: Kind, body: dict[str, Any]) -> Usage | None:
    """The usage of a whole answer, a chat/completions chunk, a Responses event, or a Messages
    event (`message_start` holds the prompt's; a `message_delta` may repeat it whole)."""
    if kind == "messages":
        message = body.get("message") if body.get("type") == "message_start" else body
        return _messages_usage(message.get("usage") if isinstance(message, dict) else None)
    if kind == "responses":
        response = body.get("response") if "response" in body else body
        usage = response.get("usage") if isinstance(response, dict) else None
        return _usage(usage, "input_tokens", "input_tokens_details")
    return _usage(body.get("usage"), "prompt_tokens", "prompt_tokens_details")


def _messages_usage(usage: Any) -> Usage | None:
    """Anthropic's split (`input_tokens` is the prompt less what was read from or written to the
    cache) as a prompt and its cached tokens; None for a usage without `input_tokens` (a
    `message_delta` that counts only the output)."""
    if not isinstance(usage, dict) or not isinstance(usage.get("input_tokens"), int):
        return None
    counts = [usage.get(key) for key in ("cache_read_input_tokens", "cache_creation_input_tokens")]
    read, written = (count if isinstance(count, int) else 0 for count in counts)
    return Usage(prompt_tokens=usage["input_tokens"] + read + written,
                 cached_tokens=read if "cache_read_input_tokens" in usage else None)


def _usage(usage: Any, prompt_key: str, details_key: str) -> Usage | None:
    if not isinstance(usage, dict) or not isinstance(usage.get(prompt_key), int):
        return None
    details = usage.get(details_key)
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(prompt_tokens=usage[prompt_key], cached_tokens=cached if isinstance(cached, int) else None)
