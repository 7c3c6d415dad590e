"""The Messages API's answer, from the typed answer the chat service returns
(gateway/protocol/answer.py): the message (from a whole answer) and its streaming events (from
the answer's events).

A message's content is its text block (if any text was written), then one tool_use block per
call (`toolu_` + the call's id). Streamed, in Anthropic's order: `message_start` (the message with
no content yet, and the prompt's usage), `ping`, then the content blocks, each
`content_block_start`, its deltas and `content_block_stop` (a text block's deltas are
`text_delta`s; a tool_use block opens with its id and name and an empty `input`, and its deltas
are `input_json_delta`s whose `partial_json` fragments add up to the input), then
`message_delta` (the stop reason and the stop sequence that ended the answer, if one did, and
the whole usage: counts there are totals) and
`message_stop`. A block closes when the next one opens or the answer ends; an error after the
first byte is an `error` event in Anthropic's envelope, which ends the stream.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from gateway.protocol.answer import Answer, AnswerEvent, CallArguments, CallStarted, Started, TextWritten, Usage
from gateway.protocol.messages import error_body

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
STOP_REASONS: dict[str, StopReason] = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id(call_id: str) -> str:
    """A chat tool call's id (`call_...`) as a tool_use block's (`toolu_...`)."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish_reason: str, stop_sequence: str | None = None) -> StopReason:
    """The answer's finish reason as Anthropic's: `stop_sequence` when one of the request's
    `stop_sequences` ended it."""
    return "stop_sequence" if stop_sequence is not None else STOP_REASONS.get(finish_reason, "end_turn")


def usage_of(usage: Usage) -> dict[str, int]:
    """Anthropic's usage: the prompt split into tokens read from the cache, tokens written to it
    and the rest (`input_tokens`); the three add up to the prompt, as Anthropic's do (clients add
    them). Both counts are prefixes of the prompt: a miss that started from part of a cached group
    (partial group reuse) read that part and wrote only the group past it, whereas chat's
    `cache_write_tokens` counts the whole group stored, as OpenAI counts writes
    (tests/api/test_messages_usage.py: hit, miss, partial group, conversation, whole and streamed)."""
    prompt = usage.prompt_tokens
    read = min(usage.cached_tokens, prompt)
    created = max(min(usage.cache_write_tokens, prompt) - read, 0)
    return {"input_tokens": prompt - read - created, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": created, "cache_read_input_tokens": read}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as a tool_use block's `input` (a call `max_tokens` cut short: `{}`)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_of(answer: Answer) -> list[dict[str, Any]]:
    """An answer as content blocks: its text (if any), then one tool_use per call."""
    blocks = [text_block(answer.content)] if answer.content else []
    for call in answer.tool_calls:
        blocks.append(tool_use_block(call.call_id, call.name, tool_input(call.arguments)))
    return blocks


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def tool_use_block(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_use_id(call_id), "name": name, "input": arguments}


def message_body(message_id: str, model: str, content: list[dict[str, Any]], reason: StopReason | None,
                 usage: dict[str, int], stop_sequence: str | None = None) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "content": content, "model": model,
            "stop_reason": reason, "stop_sequence": stop_sequence, "usage": usage}


# ---- streamed --------------------------------------------------------------------------------


class MessageEvents:
    """Answer events in (`feed`), Messages events out; `fail` ends the message early. `content`
    is the message's blocks as a client accumulates them (whole once `ended`)."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self.blocks = 0  # content blocks opened so far (the open one is the last)
        self.open: Literal["text", "tool_use"] | None = None
        self.content: list[dict[str, Any]] = []
        self.ended = False
        self._input_json = ""  # the open tool_use block's input so far

    def feed(self, event: AnswerEvent) -> list[dict[str, Any]]:
        if isinstance(event, Started):
            message = message_body(self.message_id, self.model, [], None, usage_of(event.prompt))
            return [{"type": "message_start", "message": message}, {"type": "ping"}]
        if isinstance(event, TextWritten):
            return self._write_text(event.text)
        if isinstance(event, CallStarted):
            block = tool_use_block(event.call_id, event.name, {})
            return self._close() + self._start(block, "tool_use")
        if isinstance(event, CallArguments):
            if not event.fragment or self.open != "tool_use":
                return []
            self._input_json += event.fragment
            return [self._delta({"type": "input_json_delta", "partial_json": event.fragment})]
        events = self._close()  # Ended: the closing events, with the whole answer's usage
        self.ended = True
        reason = stop_reason(event.finish_reason, event.stop_sequence)
        events.append({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": event.stop_sequence},
                       "usage": usage_of(event.usage)})
        events.append({"type": "message_stop"})
        return events

    @staticmethod
    def fail(message: str, status: int) -> list[dict[str, Any]]:
        return [error_body(message, status)]

    # ---- blocks --------------------------------------------------------------------------

    def _write_text(self, text: str) -> list[dict[str, Any]]:
        if not text:  # never an empty text block (Anthropic refuses one sent back)
            return []
        events: list[dict[str, Any]] = []
        if self.open != "text":
            events += self._close() + self._start(text_block(""), "text")
        events.append(self._delta({"type": "text_delta", "text": text}))
        self.content[-1]["text"] += text
        return events

    def _start(self, block: dict[str, Any], kind: Literal["text", "tool_use"]) -> list[dict[str, Any]]:
        self.open = kind
        self.blocks += 1
        self.content.append(dict(block))
        self._input_json = ""
        return [{"type": "content_block_start", "index": self.blocks - 1, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        if self.open == "tool_use":
            self.content[-1]["input"] = tool_input(self._input_json)
        self.open = None
        return [{"type": "content_block_stop", "index": self.blocks - 1}]
