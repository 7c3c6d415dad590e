"""Llama 3.x JSON tool calls: ``{"name": "f", "parameters": {...}}``.

The output is a call only when, stripped, it starts with ``{`` or ``<|python_tag|>``; it is
then one or more JSON objects (each optionally preceded by the tag) separated by ``;`` and/or
whitespace, with nothing else. Such an output never has content.
"""

from __future__ import annotations

from tests.support.toolcalls.base import BufferedStreamer, ParsedToolCall, ToolCallParser, decode_at, make_call, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3Parser(ToolCallParser):
    """``<|python_tag|>{"name": "f", "parameters": {...}}; {...}``"""

    name = "llama3"

    def has_calls(self, text: str) -> bool:
        return _looks_like_call(text.strip())

    def split(self, text: str) -> tuple[list[str], list[ParsedToolCall]]:
        return [], _read_calls(text.strip())  # a call output has no content

    def streamer(self) -> Llama3Streamer:
        return Llama3Streamer(self)


def _looks_like_call(body: str) -> bool:
    return body.startswith(("{", PYTHON_TAG))


def _read_calls(body: str) -> list[ParsedToolCall]:
    calls: list[ParsedToolCall] = []
    pos = 0
    while pos < len(body):
        if body.startswith(PYTHON_TAG, pos):
            pos += len(PYTHON_TAG)
        obj, pos = decode_at(body, skip_ws(body, pos))
        calls.append(make_call(obj, ("parameters", "arguments")))
        pos = _skip_separator(body, pos)
    return calls


def _skip_separator(body: str, pos: int) -> int:
    pos = skip_ws(body, pos)
    if body.startswith(";", pos):
        pos = skip_ws(body, pos + 1)
    return pos


class Llama3Streamer(BufferedStreamer):
    """Decides from the first non-blank characters whether the output is calls or plain text."""

    def __init__(self, parser: ToolCallParser) -> None:
        super().__init__(parser)
        self._plain = False

    def _scan(self, pending: str) -> tuple[int, bool]:
        if self._plain:
            return len(pending), False
        head = pending.lstrip()  # nothing has been emitted yet: pending is the whole output
        if _looks_like_call(head):
            return 0, True
        if not head or PYTHON_TAG.startswith(head):
            return 0, False  # undecided
        self._plain = True
        return len(pending), False
