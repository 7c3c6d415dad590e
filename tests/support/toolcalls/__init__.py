"""The whole-text tool-call parsers, one per syntax: the oracle a streamed answer is checked
against (a stream replayed token by token spells what the whole text parses to).

``get_parser("hermes" | "llama3" | "mistral")`` returns a ``ToolCallParser``; base.py states the
content / failure semantics they share.
"""

from __future__ import annotations

from tests.support.toolcalls.base import ParsedOutput, ParsedToolCall, ToolCallParser
from tests.support.toolcalls.hermes import HermesParser
from tests.support.toolcalls.llama3 import Llama3Parser
from tests.support.toolcalls.mistral import MistralParser

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


__all__ = ["HermesParser", "Llama3Parser", "MistralParser", "ParsedOutput", "ParsedToolCall", "ToolCallParser",
           "get_parser", "parser_names"]
