"""Mistral tool calls: ``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]``.

Also the newer (v11 tokenizer) form ``[TOOL_CALLS]f[ARGS]{...}``, optionally with
``[CALL_ID]id`` before ``[ARGS]``, repeated once per call. Text outside the blocks is content.
"""

from __future__ import annotations

import re

from tests.support.toolcalls.base import (
    MarkerStreamer,
    ParsedOutput,
    ParsedToolCall,
    ParseError,
    ToolCallParser,
    ToolCallStreamer,
    call_from,
    decode_at,
    failed,
    make_call,
    plain,
    skip_ws,
    succeeded,
)

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[\w.:\-]+")


class MistralParser(ToolCallParser):
    """``[TOOL_CALLS] [{...}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}``"""

    name = "mistral"

    def parse(self, text: str) -> ParsedOutput:
        if MARKER not in text:
            return plain(text)
        try:
            parts, calls = _split_blocks(text)
        except ParseError:
            return failed(text)
        return succeeded(parts, calls)

    def streamer(self) -> ToolCallStreamer:
        return MarkerStreamer(self, MARKER)


def _split_blocks(text: str) -> tuple[list[str], list[ParsedToolCall]]:
    parts: list[str] = []
    calls: list[ParsedToolCall] = []
    pos = 0
    while (start := text.find(MARKER, pos)) >= 0:
        parts.append(text[pos:start])
        block_calls, pos = _read_block(text, start + len(MARKER))
        calls += block_calls
    parts.append(text[pos:])
    return parts, calls


def _read_block(text: str, pos: int) -> tuple[list[ParsedToolCall], int]:
    """Read what follows a marker; return its calls and the index after them."""
    pos = skip_ws(text, pos)
    if not text.startswith(("[", "{"), pos):
        return _read_named(text, pos)
    value, end = decode_at(text, pos)
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ParseError("empty tool call list")
    return [make_call(item) for item in items], end


def _read_named(text: str, pos: int) -> tuple[list[ParsedToolCall], int]:
    """``name[ARGS]{...}`` or ``name[CALL_ID]id[ARGS]{...}``."""
    args_at = text.find(ARGS, pos)
    if args_at < 0:
        raise ParseError(f"expected {ARGS}")
    name = text[pos:args_at].split(CALL_ID, 1)[0].strip()
    if not _NAME.fullmatch(name):
        raise ParseError(f"bad function name {name!r}")
    obj, end = decode_at(text, skip_ws(text, args_at + len(ARGS)))
    return [call_from(name, obj)], end
