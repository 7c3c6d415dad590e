"""Hermes / ChatML tool calls (Qwen2/2.5/3, SmolLM): ``<tool_call>{json}</tool_call>`` blocks.

Any number of blocks may follow or surround plain text; whitespace and text outside the blocks
is content. A final block may lack its closing tag (the model stopped) if its JSON is complete.
"""

from __future__ import annotations

from tests.support.toolcalls.base import (
    MarkerStreamer,
    ParsedOutput,
    ParsedToolCall,
    ParseError,
    ToolCallParser,
    ToolCallStreamer,
    decode_at,
    failed,
    make_call,
    plain,
    skip_ws,
    succeeded,
)

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesParser(ToolCallParser):
    """``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``"""

    name = "hermes"

    def parse(self, text: str) -> ParsedOutput:
        if OPEN not in text:
            return plain(text)
        try:
            parts, calls = _split_blocks(text)
        except ParseError:
            return failed(text)
        return succeeded(parts, calls)

    def streamer(self) -> ToolCallStreamer:
        return MarkerStreamer(self, OPEN)


def _split_blocks(text: str) -> tuple[list[str], list[ParsedToolCall]]:
    """Text segments outside the blocks, and the call of every block."""
    parts: list[str] = []
    calls: list[ParsedToolCall] = []
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        parts.append(text[pos:start])
        call, pos = _read_block(text, start + len(OPEN))
        calls.append(call)
    parts.append(text[pos:])
    return parts, calls


def _read_block(text: str, pos: int) -> tuple[ParsedToolCall, int]:
    """Read the JSON after an opening tag; return the call and the index after the block."""
    obj, end = decode_at(text, skip_ws(text, pos))
    end = skip_ws(text, end)
    if text.startswith(CLOSE, end):
        return make_call(obj), end + len(CLOSE)
    if end == len(text):  # generation stopped before the closing tag
        return make_call(obj), end
    raise ParseError(f"expected {CLOSE} at offset {end}")
