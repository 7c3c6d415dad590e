"""What the model wrote, as OpenAI's answer: the assistant message with its tool calls (a whole
answer), the deltas of a streamed one, and the finish reason a turn with calls gets."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from adapters.base import ChatFamily
from adapters.toolcalls import ContentDelta, ToolCallArgsDelta, ToolCallStart
from adapters.toolcalls.incremental import SyntaxStreamer
from gateway.engine import EngineEvent, Finished
from gateway.protocol import chat_output
from gateway.serving.jobs import Prepared


def assistant_message(family: ChatFamily, text: str, prepared: Prepared, finish: Finished,
                      on_parse_failure: Callable[[], None]) -> tuple[dict[str, Any], str]:
    """The assistant message and finish reason. A tool turn is read by the same streamer the
    streamed response uses (its output follows the family's call syntax: the grammar saw to
    that), so both carry the same content and calls. A call cut off by `max_tokens` comes
    back as OpenAI returns it: the call with the arguments written so far, finish `length`."""
    if not prepared.tools_active:
        return {"role": "assistant", "content": text, "refusal": None}, finish.finish_reason
    streamer = SyntaxStreamer(family.call_syntax())
    pieces = streamer.feed(prepared.forced_opening + text) + streamer.finish()
    if streamer.parse_failed:
        on_parse_failure()
    content = "".join(p.text for p in pieces if isinstance(p, ContentDelta)) or None
    calls: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        if isinstance(piece, ToolCallStart) and not (prepared.single_call and piece.index > 0):
            calls[piece.index] = {"id": chat_output.new_tool_call_id(), "type": "function",
                                  "function": {"name": piece.name, "arguments": ""}}
        elif isinstance(piece, ToolCallArgsDelta) and piece.index in calls:
            calls[piece.index]["function"]["arguments"] += piece.fragment
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if not calls:
        return message, finish.finish_reason
    message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, call_finish(finish)


class CallTracker:
    """Turns parser deltas into OpenAI delta dicts; gives each call an id once."""

    def __init__(self, single: bool) -> None:
        self.single = single
        self.count = 0

    def deltas(self, pieces: list[Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, ContentDelta):
                if piece.text:
                    out.append({"content": piece.text})
            elif self.single and getattr(piece, "index", 0) > 0:
                continue
            elif isinstance(piece, ToolCallStart):
                self.count += 1
                out.append({"tool_calls": [{"index": piece.index, "id": chat_output.new_tool_call_id(),
                                            "type": "function",
                                            "function": {"name": piece.name, "arguments": ""}}]})
            elif isinstance(piece, ToolCallArgsDelta):
                out.append({"tool_calls": [{"index": piece.index,
                                            "function": {"arguments": piece.fragment}}]})
        return out


async def chain(first: EngineEvent, rest: AsyncIterator[EngineEvent]) -> AsyncIterator[EngineEvent]:
    yield first
    async for event in rest:
        yield event


def call_finish(finish: Finished) -> str:
    """A turn with calls ends `tool_calls`, unless `max_tokens` cut it (OpenAI's `length`)."""
    return "length" if finish.finish_reason == "length" and finish.completion_tokens > 0 else "tool_calls"
