"""The whole-text tool-call parsers, the tests' oracle: types, JSON helpers and the buffered
streamers every syntax shares (toolkv streams calls with adapters/toolcalls/incremental.py).

Semantics shared by all parsers (``parse`` and the streamers agree exactly):

* Content is all text outside the successfully parsed call blocks, concatenated and
  ``str.strip()``-ped; ``None`` when that leaves nothing.
* Parsing is all-or-nothing: when the text looks like a call (it has the syntax's opening
  marker) but any block cannot be parsed, the result has ``parse_failed=True``, no tool calls
  and ``content == text.strip()`` (the whole raw text minus surrounding whitespace).
* Arguments are always ``json.dumps(obj, ensure_ascii=False)`` of a JSON object.

Because a later broken block voids every call, no call is certain before the end of the
output: streamers pass plain content through as it arrives (holding back whitespace and
anything that may be the start of a marker), buffer the call section, and emit the calls
(and any content after them) from ``finish()``.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from adapters.toolcalls import incremental as stream
from adapters.toolcalls.incremental import StreamDelta, ToolCallStreamer


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text: json.dumps(obj, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None
    tool_calls: tuple[ParsedToolCall, ...]
    parse_failed: bool


class ToolCallParser(ABC):
    """Turns one model output into content and tool calls; one subclass per syntax, which says
    when an output holds calls and how to split it into content and calls."""

    name: str

    def parse(self, text: str) -> ParsedOutput:
        """Parse a whole output: plain, failed as a whole, or content and calls."""
        if not self.has_calls(text):
            return plain(text)
        try:
            parts, calls = self.split(text)
        except ParseError:
            return failed(text)
        return succeeded(parts, calls)

    @abstractmethod
    def has_calls(self, text: str) -> bool:
        """The output looks like a call (it has the syntax's opening)."""

    @abstractmethod
    def split(self, text: str) -> tuple[list[str], list[ParsedToolCall]]:
        """The text segments outside the calls, and the calls; ParseError when one is broken."""

    @abstractmethod
    def streamer(self) -> ToolCallStreamer:
        """A fresh incremental parser for one generation."""


class BlockParser(ToolCallParser):
    """Syntaxes whose calls stand in blocks, each opened by `marker`, with content around them."""

    marker: str

    def has_calls(self, text: str) -> bool:
        return self.marker in text

    def split(self, text: str) -> tuple[list[str], list[ParsedToolCall]]:
        parts: list[str] = []
        calls: list[ParsedToolCall] = []
        pos = 0
        while (start := text.find(self.marker, pos)) >= 0:
            parts.append(text[pos:start])
            block_calls, pos = self.read_block(text, start + len(self.marker))
            calls += block_calls
        parts.append(text[pos:])
        return parts, calls

    @abstractmethod
    def read_block(self, text: str, pos: int) -> tuple[list[ParsedToolCall], int]:
        """The calls of the block whose body starts at `pos`, and the index after the block."""

    def streamer(self) -> ToolCallStreamer:
        return MarkerStreamer(self, self.marker)


class ParseError(ValueError):
    """Raised by the helpers below; parsers turn it into ``parse_failed``."""


def _reject_constant(token: str) -> Any:
    raise ParseError(f"non-standard JSON constant {token}")


_DECODER = json.JSONDecoder(strict=False, parse_constant=_reject_constant)


def skip_ws(text: str, pos: int) -> int:
    """Index of the first non-whitespace character at or after ``pos``."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def decode_at(text: str, pos: int) -> tuple[Any, int]:
    """Decode one JSON value starting exactly at ``pos``; return it and the end index."""
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError as exc:  # JSONDecodeError, or ParseError from a constant
        raise ParseError(str(exc)) from exc


def make_call(obj: Any, arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedToolCall:
    """Validate a ``{"name": ..., "arguments": {...}}`` object and normalise it."""
    if not isinstance(obj, dict):
        raise ParseError("tool call is not a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ParseError("tool call has no name")
    raw: Any = next((obj[key] for key in arg_keys if key in obj), {})
    return call_from(name.strip(), raw)


def call_from(name: str, raw_args: Any) -> ParsedToolCall:
    """Build a call from a name and arguments given as an object or as JSON text."""
    if isinstance(raw_args, str):
        raw_args = _object_from_text(raw_args)
    if not isinstance(raw_args, dict):
        raise ParseError("tool call arguments are not a JSON object")
    return ParsedToolCall(name=name, arguments=json.dumps(raw_args, ensure_ascii=False))


def _object_from_text(text: str) -> Any:
    if not text.strip():
        return {}
    value, end = decode_at(text, skip_ws(text, 0))
    if skip_ws(text, end) != len(text):
        raise ParseError("trailing text after arguments")
    return value


def plain(text: str) -> ParsedOutput:
    """Output without any tool call."""
    return ParsedOutput(content=text.strip() or None, tool_calls=(), parse_failed=False)


def failed(text: str) -> ParsedOutput:
    """Output that looked like a call but did not parse."""
    return ParsedOutput(content=text.strip() or None, tool_calls=(), parse_failed=True)


def succeeded(parts: list[str], calls: list[ParsedToolCall]) -> ParsedOutput:
    """Output with calls; ``parts`` are the text segments outside the call blocks."""
    return ParsedOutput(content="".join(parts).strip() or None, tool_calls=tuple(calls),
                        parse_failed=False)


class BufferedStreamer(ToolCallStreamer):
    """Content passes through; the call section is buffered and resolved by ``parse`` at finish.

    States: CONTENT (scanning for the start of the call section) -> CALLS (buffering) -> DONE.
    Subclasses only say where, in the not-yet-emitted text, the call section could begin.
    """

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._chunks: list[str] = []
        self._pending = ""  # content not yet emitted (whitespace, possible marker start)
        self._emitted = 0  # characters of content emitted so far
        self._in_calls = False
        self._done = False
        self._saw_call = False
        self._failed = False

    @property
    def saw_tool_call(self) -> bool:
        return self._saw_call

    @property
    def parse_failed(self) -> bool:
        return self._failed

    @abstractmethod
    def _scan(self, pending: str) -> tuple[int, bool]:
        """Return ``(safe, calls_start)``: ``pending[:safe]`` is certainly content;
        ``calls_start`` says the call section begins at ``safe``."""

    def feed(self, text_delta: str) -> list[StreamDelta]:
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._chunks.append(text_delta)
        if self._in_calls or not text_delta:
            return []
        self._pending += text_delta
        safe, calls_start = self._scan(self._pending)
        return self._emit_content(safe, calls_start)

    def _emit_content(self, safe: int, calls_start: bool) -> list[StreamDelta]:
        head = self._pending[:safe].rstrip()  # trailing whitespace may turn out to end the content
        self._pending = "" if calls_start else self._pending[len(head):]
        self._in_calls = calls_start
        text = head if self._emitted else head.lstrip()
        self._emitted += len(text)
        return [stream.ContentDelta(text)] if text else []

    def finish(self) -> list[StreamDelta]:
        if self._done:
            return []
        self._done = True
        result = self._parser.parse("".join(self._chunks))
        self._failed = result.parse_failed
        self._saw_call = bool(result.tool_calls)
        rest = (result.content or "")[self._emitted:]  # what was emitted is a prefix of it
        out: list[StreamDelta] = [stream.ContentDelta(rest)] if rest else []
        for index, call in enumerate(result.tool_calls):
            out += [stream.ToolCallStart(index, call.name), stream.ToolCallArgsDelta(index, call.arguments)]
        return out


class MarkerStreamer(BufferedStreamer):
    """Streamer for syntaxes whose call section starts at the first occurrence of a marker."""

    def __init__(self, parser: ToolCallParser, marker: str) -> None:
        super().__init__(parser)
        self._marker = marker

    def _scan(self, pending: str) -> tuple[int, bool]:
        found = pending.find(self._marker)
        if found >= 0:
            return found, True
        return len(pending) - stream.marker_prefix_len(pending, self._marker), False
