"""The tool-call streamer toolkv runs (adapters/toolcalls/incremental.py `SyntaxStreamer`), replayed
token by token, spells exactly what the whole-text oracle (tests/support/toolcalls/) reads from
the same output: the same content, the same calls in order, arguments that parse to the same
object; for every family's call syntax, whatever the output's split into tokens."""

from __future__ import annotations

import json
import re

import pytest

from adapters.base import ChatMessage, ToolCallIn
from adapters.families import get_family
from adapters.toolcalls import ContentDelta, StreamDelta, ToolCallArgsDelta, ToolCallStart
from adapters.toolcalls.incremental import SyntaxStreamer
from tests.support.toolcalls import get_parser

FAMILIES = ["chatml", "llama3", "mistral"]
ARGUMENTS = ['{"order_id": "#W1", "n": 2}', "{}", '{"note": "caf\\u00e9 \\"quoted\\" {braces}", "tags": ["a", "b"]}',
             '{"filter": {"nested": {"deep": [1, 2.5, null, true]}}}']


def outputs(family: str) -> list[str]:
    fam = get_family(family)
    several = ChatMessage("assistant", None, (ToolCallIn("call_1", "a", '{"x": 1}'), ToolCallIn("call_2", "b", "{}")))
    texts = ["Plain text, no call.", fam.assistant_text(several)]
    texts += [fam.call_text("get_order", args) for args in ARGUMENTS]
    if not fam.call_syntax().leading_only:  # text before a call: not in a syntax whose calls are the whole output
        texts.append("Let me look that up. " + fam.call_text("get_order", ARGUMENTS[0]))
    return texts


def by_char(text: str) -> list[str]:
    return list(text)


def by_word(text: str) -> list[str]:
    """Markers in pieces (`<`, `tool_call`, `>`), spaces glued to words, as a BPE vocabulary splits."""
    return re.findall(r"\s?\w+|\s+|[^\w\s]{1,2}", text) or [text]


def replay(family: str, chunks: list[str]) -> tuple[str | None, list[tuple[str, object]], bool]:
    streamer = SyntaxStreamer(get_family(family).call_syntax())
    deltas: list[StreamDelta] = []
    for chunk in chunks:
        deltas += streamer.feed(chunk)
    deltas += streamer.finish()
    names = [d.name for d in deltas if isinstance(d, ToolCallStart)]
    fragments = ["".join(d.fragment for d in deltas if isinstance(d, ToolCallArgsDelta) and d.index == i)
                 for i in range(len(names))]
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta)) or None
    return content, [(name, json.loads(args)) for name, args in zip(names, fragments, strict=True)], \
        streamer.parse_failed


@pytest.mark.parametrize("split", [by_char, by_word])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_streamed_calls_are_what_the_whole_text_oracle_reads(family: str, split) -> None:
    oracle = get_parser(get_family(family).tool_parser)
    for text in outputs(family):
        parsed = oracle.parse(text)
        expected = [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]
        assert replay(family, split(text)) == (parsed.content, expected, False), text
