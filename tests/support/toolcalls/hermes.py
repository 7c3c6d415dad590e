"""Hermes / ChatML tool calls (Qwen2/2.5/3, SmolLM): ``<tool_call>{json}</tool_call>`` blocks.

Any number of blocks may follow or surround plain text; whitespace and text outside the blocks
is content. A final block may lack its closing tag (the model stopped) if its JSON is complete.
"""

from __future__ import annotations

from tests.support.toolcalls.base import BlockParser, ParsedToolCall, ParseError, decode_at, make_call, skip_ws

CLOSE = "</tool_call>"


class HermesParser(BlockParser):
    """``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``"""

    name = "hermes"
    marker = "<tool_call>"

    def read_block(self, text: str, pos: int) -> tuple[list[ParsedToolCall], int]:
        """The JSON after an opening tag, up to its closing tag (or the end: generation stopped)."""
        obj, end = decode_at(text, skip_ws(text, pos))
        end = skip_ws(text, end)
        if text.startswith(CLOSE, end):
            return [make_call(obj)], end + len(CLOSE)
        if end == len(text):  # generation stopped before the closing tag
            return [make_call(obj)], end
        raise ParseError(f"expected {CLOSE} at offset {end}")
