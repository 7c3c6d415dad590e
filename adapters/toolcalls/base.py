"""What a tool-call streamer gives out, and the contract every streamer keeps: content deltas, a
call's start (`index`, name) and its arguments in fragments (incremental.py's `SyntaxStreamer`
writes them for every family's `CallSyntax`).

The whole-text parsers that once sat beside it were used by tests alone; they are the tests'
oracle now (tests/support/toolcalls/: a stream replayed token by token must spell what the
whole text parses to).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TypeAlias


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgsDelta:
    index: int
    fragment: str


StreamDelta: TypeAlias = ContentDelta | ToolCallStart | ToolCallArgsDelta


class ToolCallStreamer(ABC):
    """Incremental parser: text deltas in, OpenAI-shaped deltas out."""

    @abstractmethod
    def feed(self, text_delta: str) -> list[StreamDelta]:
        """Consume the next piece of generated text."""

    @abstractmethod
    def finish(self) -> list[StreamDelta]:
        """Flush everything held back; call once at the end of generation."""

    @property
    @abstractmethod
    def saw_tool_call(self) -> bool:
        """True once a ToolCallStart has been emitted."""

    @property
    @abstractmethod
    def parse_failed(self) -> bool:
        """True (after finish) when the output looked like a call but could not be parsed."""


def marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
