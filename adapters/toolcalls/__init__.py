"""Parse model output into OpenAI tool calls, whole-text or streaming, for several syntaxes.

``get_parser("hermes" | "llama3" | "mistral")`` returns a ``ToolCallParser``; see
``adapters.toolcalls.base`` for the exact content / failure semantics shared by all of them.
"""

from __future__ import annotations

from adapters.toolcalls.base import (
    ContentDelta,
    ParsedOutput,
    ParsedToolCall,
    StreamDelta,
    ToolCallArgsDelta,
    ToolCallParser,
    ToolCallStart,
    ToolCallStreamer,
)
from adapters.toolcalls.hermes import HermesParser
from adapters.toolcalls.llama3 import Llama3Parser
from adapters.toolcalls.mistral import MistralParser

_PARSERS: dict[str, type[ToolCallParser]] = {
    HermesParser.name: HermesParser,
    Llama3Parser.name: Llama3Parser,
    MistralParser.name: MistralParser,
}


def parser_names() -> tuple[str, ...]:
    """The valid names for ``get_parser``, sorted."""
    return tuple(sorted(_PARSERS))


def get_parser(name: str) -> ToolCallParser:
    """A parser for the named syntax; ValueError naming the valid choices otherwise."""
    try:
        return _PARSERS[name]()
    except KeyError:
        choices = ", ".join(parser_names())
        raise ValueError(f"unknown tool-call parser {name!r}; valid choices: {choices}") from None


__all__ = [
    "ContentDelta",
    "HermesParser",
    "Llama3Parser",
    "MistralParser",
    "ParsedOutput",
    "ParsedToolCall",
    "StreamDelta",
    "ToolCallArgsDelta",
    "ToolCallParser",
    "ToolCallStart",
    "ToolCallStreamer",
    "get_parser",
    "parser_names",
]
