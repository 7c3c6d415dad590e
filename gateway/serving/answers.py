"""What the model wrote, as the typed answer every API renders (gateway/protocol/answer.py): the
content and tool calls of a whole answer, the events of a streamed one, and the finish reason a
turn with calls gets."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapters.base import ChatFamily
from adapters.toolcalls import ContentDelta, ToolCallArgsDelta, ToolCallStart
from adapters.toolcalls.incremental import SyntaxStreamer
from gateway.engine import Finished, TextDelta
from gateway.protocol import chat_output
from gateway.protocol.answer import (
    AnswerEvent,
    CallArguments,
    CallStarted,
    Ended,
    FinishReason,
    Logprobs,
    Started,
    TextWritten,
    ToolCall,
    Usage,
)
from gateway.serving.jobs import Prepared
from gateway.serving.logprobs import StreamLogprobs, TokenTexts


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


class StreamedAnswer:
    """One streamed answer: the engine's events in, the answer's events out (`start` once the
    prompt is in, `write` per text delta, `end` with the finish). Plain calls, no generator: the
    service's one generator drives it."""

    def __init__(self, family: ChatFamily, prepared: Prepared, token_texts: TokenTexts,
                 on_parse_failure: Callable[[], None]) -> None:
        self.prepared = prepared
        self.logprobs = StreamLogprobs(token_texts if prepared.job.params.logprobs else None,
                                       prepared.job.keep_token_ids)
        self.streamer = SyntaxStreamer(family.call_syntax()) if prepared.tools_active else None
        self.calls = CallTracker(single=prepared.single_call)
        self.on_parse_failure = on_parse_failure

    def start(self, prompt: Usage) -> list[AnswerEvent]:
        """`Started`, then the forced call's opening (written by us, not the model)."""
        opening = self.prepared.forced_opening
        pieces = self.streamer.feed(opening) if self.streamer is not None and opening else []
        return [Started(prompt, bool(opening)), *self.calls.events(pieces)]

    def write(self, delta: TextDelta) -> list[AnswerEvent]:
        self.logprobs.add(delta.logprobs)
        pieces = self.streamer.feed(delta.text) if self.streamer is not None else [ContentDelta(delta.text)]
        return self.calls.events(pieces, self.logprobs.take)

    def end(self, finish: Finished, usage: Usage) -> list[AnswerEvent]:
        """The calls' last pieces, then `Ended` with the entries no event carried."""
        events: list[AnswerEvent] = []
        if self.streamer is not None:
            events = self.calls.events(self.streamer.finish(), self.logprobs.take)
            if self.streamer.parse_failed:
                self.on_parse_failure()
        reason = call_finish(finish) if self.calls.count else finish.finish_reason
        events.append(Ended(reason, usage, self.logprobs.take(), finish.stop_sequence))
        return events


def call_finish(finish: Finished) -> FinishReason:
    """A turn with calls ends `tool_calls`, unless `max_tokens` cut it (OpenAI's `length`)."""
    return "length" if finish.finish_reason == "length" and finish.completion_tokens > 0 else "tool_calls"
