"""Tool calls streamed out of model output as it is generated: what a streamer gives out
(content deltas, a call's start with its `index` and name, its arguments in fragments), the
contract every streamer keeps (`ToolCallStreamer`), and `SyntaxStreamer`, which writes them for
output that follows a family's CallSyntax (a constrained turn always does:
gateway/serving/grammars.py).

A call's start goes out as soon as its name's closing quote arrives, then its
arguments in fragments as they are written, the model's JSON text verbatim, so the fragments
concatenate to arguments that parse to the object the non-streamed parser reports. Content is
the text before the call section, stripped as the parsers strip it; no call markup ever reaches
it. Output that leaves the syntax (it cannot when constrained; a call cut off by `max_tokens`
stops early) marks `parse_failed` and streams nothing more.

The whole-text parsers that once sat beside it were used by tests alone; they are the tests'
oracle now (tests/support/toolcalls/: a stream replayed token by token must spell what the
whole text parses to).
"""

from __future__ import annotations

import enum
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TypeAlias

from adapters.base import CallSyntax


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


class _State(enum.Enum):
    CONTENT = "content"
    LITERAL = "literal"  # expecting fixed text (`_expect`), then `_then`
    NAME = "name"
    ARGS = "args"
    AFTER_CALL = "after_call"
    END = "end"
    FAILED = "failed"


class SyntaxStreamer(ToolCallStreamer):
    def __init__(self, syntax: CallSyntax) -> None:
        self._syntax = syntax
        self._state = _State.CONTENT
        self._buf = ""
        self._expect = ""
        self._then = _State.NAME
        self._index = -1
        self._emitted_content = False
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._decided = not syntax.leading_only  # leading_only: calls only if the output opens with one
        self._plain = False

    @property
    def saw_tool_call(self) -> bool:
        return self._index >= 0

    @property
    def parse_failed(self) -> bool:
        return self._state is _State.FAILED

    def feed(self, text_delta: str) -> list[StreamDelta]:
        self._buf += text_delta
        out: list[StreamDelta] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[StreamDelta]:
        out: list[StreamDelta] = []
        if self._state is _State.CONTENT:
            self._content(self._buf.strip() if not self._emitted_content else self._buf.rstrip(), out)
            self._buf = ""
        elif self._state in (_State.LITERAL, _State.NAME, _State.ARGS):
            self._state = _State.FAILED  # a call cut off before its end
        self._state = _State.END if self._state is not _State.FAILED else self._state
        return out

    # ---- states ------------------------------------------------------------------------------

    def _step(self, out: list[StreamDelta]) -> bool:
        """Advance as far as the buffer allows; True when another step may make progress."""
        state = self._state
        if state is _State.CONTENT:
            return self._scan_content(out)
        if state is _State.LITERAL:
            return self._literal()
        if state is _State.NAME:
            return self._name(out)
        if state is _State.ARGS:
            return self._args(out)
        if state is _State.AFTER_CALL:
            return self._after_call()
        self._buf = ""  # END and FAILED: nothing more is streamed
        return False

    def _scan_content(self, out: list[StreamDelta]) -> bool:
        trigger = self._syntax.trigger
        if not self._decided:
            head = self._buf.lstrip()
            if not head or trigger.startswith(head):
                return False  # not known yet
            self._decided = True
            if head.startswith(trigger):
                self._buf = head
                self._open_section()
                return True
            self._plain = True  # the output does not open with a call: all of it is content
        found = -1 if self._plain else self._buf.find(trigger)
        if found >= 0:
            self._content(self._buf[:found].rstrip(), out)
            self._buf = self._buf[found:]
            self._open_section()
            return True
        keep = 0 if self._plain else marker_prefix_len(self._buf, trigger)
        head = self._buf[: len(self._buf) - keep].rstrip()  # trailing whitespace may turn out to end the content
        self._content(head, out)
        self._buf = self._buf[len(head):]
        return False

    def _content(self, text: str, out: list[StreamDelta]) -> None:
        if not self._emitted_content:
            text = text.lstrip()
        if text:
            self._emitted_content = True
            out.append(ContentDelta(text))

    def _open_section(self) -> None:
        self._expect, self._then, self._state = self._syntax.head, _State.NAME, _State.LITERAL

    def _literal(self) -> bool:
        if self._buf.startswith(self._expect):
            self._buf = self._buf[len(self._expect):]
            self._state = self._then
            return True
        if self._expect.startswith(self._buf):
            return False  # wait for more
        self._state = _State.FAILED
        return False

    def _name(self, out: list[StreamDelta]) -> bool:
        if not self._buf:
            return False
        if not self._buf.startswith('"'):
            self._state = _State.FAILED
            return False
        escaped = False
        for i in range(1, len(self._buf)):
            c = self._buf[i]
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                try:
                    name = json.loads(self._buf[: i + 1])
                except ValueError:
                    self._state = _State.FAILED
                    return False
                self._buf = self._buf[i + 1:]
                self._index += 1
                out.append(ToolCallStart(self._index, name))
                self._expect, self._then, self._state = self._syntax.name_to_args, _State.ARGS, _State.LITERAL
                self._depth, self._in_string, self._escaped = 0, False, False
                return True
        return False

    def _args(self, out: list[StreamDelta]) -> bool:
        if not self._buf:
            return False
        if self._depth == 0 and not self._buf.lstrip().startswith("{"):
            if self._buf.strip():
                self._state = _State.FAILED
            return False
        end = None
        for i, c in enumerate(self._buf):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        fragment = self._buf if end is None else self._buf[:end]
        if fragment:
            out.append(ToolCallArgsDelta(self._index, fragment))
        self._buf = "" if end is None else self._buf[end:]
        if end is None:
            return False
        self._expect, self._then, self._state = self._syntax.call_close, _State.AFTER_CALL, _State.LITERAL
        return True

    def _after_call(self) -> bool:
        syntax = self._syntax
        more = syntax.separator + syntax.call_open
        if self._buf.startswith(more):
            self._buf = self._buf[len(more):]
            self._state = _State.NAME
            return True
        if syntax.section_close and self._buf.startswith(syntax.section_close):
            self._buf = self._buf[len(syntax.section_close):]
            self._state = _State.END
            return True
        if more.startswith(self._buf) or syntax.section_close.startswith(self._buf):
            return False  # not known yet (both may be waiting on the same characters)
        self._state = _State.END  # trailing text after the calls: not part of any call
        return True
