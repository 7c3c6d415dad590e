"""Mistral tool calls: ``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]``.

Also the newer (v11 tokenizer) form ``[TOOL_CALLS]f[ARGS]{...}``, optionally with
``[CALL_ID]id`` before ``[ARGS]``, repeated once per call. Text outside the blocks is content.
"""

from __future__ import annotations

import re

from tests.support.toolcalls.base import (
    BlockParser,
    ParsedToolCall,
    ParseError,
    call_from,
    decode_at,
    make_call,
    skip_ws,
)

ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[\w.:\-]+")


class MistralParser(BlockParser):
    """``[TOOL_CALLS] [{...}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}``"""

    name = "mistral"
    marker = "[TOOL_CALLS]"

    def read_block(self, text: str, pos: int) -> tuple[list[ParsedToolCall], int]:
        """What follows a marker: a list of calls, one call, or a named call."""
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
