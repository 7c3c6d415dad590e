"""What the model wrote, as the typed answer every API renders (gateway/protocol/answer.py): the
content and tool calls of a whole answer, the events of a streamed one, and the finish reason a
turn with calls gets."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from adapters.base import ChatFamily
from adapters.toolcalls import ContentDelta, ToolCallArgsDelta, ToolCallStart
from adapters.toolcalls.incremental import SyntaxStreamer
from gateway.engine import Finished
from gateway.protocol import chat_output
from gateway.protocol.answer import (
    AnswerEvent,
    CallArguments,
    CallStarted,
    FinishReason,
    Logprobs,
    TextWritten,
    ToolCall,
)
from gateway.serving.jobs import Prepared

T = TypeVar("T")


def content_and_calls(family: ChatFamily, text: str, prepared: Prepared, finish: Finished,
                      on_parse_failure: Callable[[], None]) -> tuple[str | None, tuple[ToolCall, ...], FinishReason]:
    """The answer's content, calls and finish reason. A tool turn is read by the same streamer the
    streamed response uses (its output follows the family's call syntax: the grammar saw to
    that), so both carry the same content and calls. A call cut off by `max_tokens` comes
    back as OpenAI returns it: the call with the arguments written so far, finish `length`."""
    if not prepared.tools_active:
        return text, (), finish.finish_reason
    streamer = SyntaxStreamer(family.call_syntax())
    pieces = streamer.feed(prepared.forced_opening + text) + streamer.finish()
    if streamer.parse_failed:
        on_parse_failure()
    content = "".join(p.text for p in pieces if isinstance(p, ContentDelta)) or None
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for piece in pieces:
        if isinstance(piece, ToolCallStart) and not (prepared.single_call and piece.index > 0):
            names[piece.index], arguments[piece.index] = piece.name, []
        elif isinstance(piece, ToolCallArgsDelta) and piece.index in names:
            arguments[piece.index].append(piece.fragment)
    calls = tuple(ToolCall(chat_output.new_tool_call_id(), names[i], "".join(arguments[i])) for i in sorted(names))
    return content, calls, call_finish(finish) if calls else finish.finish_reason


class CallTracker:
    """Turns parser pieces into answer events; gives each call an id once. `take_logprobs` gives
    each event the entries not sent yet (None: none, or not asked)."""

    def __init__(self, single: bool) -> None:
        self.single = single
        self.count = 0

    def events(self, pieces: list[Any], take_logprobs: Callable[[], Logprobs] = lambda: None) -> list[AnswerEvent]:
        out: list[AnswerEvent] = []
        for piece in pieces:
            if isinstance(piece, ContentDelta):
                if piece.text:
                    out.append(TextWritten(piece.text, take_logprobs()))
            elif self.single and getattr(piece, "index", 0) > 0:
                continue
            elif isinstance(piece, ToolCallStart):
                self.count += 1
                out.append(CallStarted(piece.index, chat_output.new_tool_call_id(), piece.name, take_logprobs()))
            elif isinstance(piece, ToolCallArgsDelta):
                out.append(CallArguments(piece.index, piece.fragment, take_logprobs()))
        return out


async def chain(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """`first` (taken to see the stream start), then the rest."""
    yield first
    async for event in rest:
        yield event


def call_finish(finish: Finished) -> FinishReason:
    """A turn with calls ends `tool_calls`, unless `max_tokens` cut it (OpenAI's `length`)."""
    return "length" if finish.finish_reason == "length" and finish.completion_tokens > 0 else "tool_calls"
