"""The Messages API's answer, from what the chat service returns: the message (from a whole
completion) and its streaming events (from the stream's chunks).

A message's content is its text block (if any text was written), then one tool_use block per
call (`toolu_` + the call's id). Streamed, in Anthropic's order: `message_start` (the message with
no content yet, and the prompt's usage), `ping`, then the content blocks, each
`content_block_start`, its deltas and `content_block_stop` (a text block's deltas are
`text_delta`s; a tool_use block opens with its id and name and an empty `input`, and its deltas
are `input_json_delta`s whose `partial_json` fragments add up to the input), then
`message_delta` (the stop reason, and the whole usage: counts there are totals) and
`message_stop`. A block closes when the next one opens or the answer ends; an error after the
first byte is an `error` event in Anthropic's envelope, which ends the stream.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from gateway.protocol.messages import error_body

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
STOP_REASONS: dict[str, StopReason] = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id(call_id: str) -> str:
    """A chat tool call's id (`call_...`) as a tool_use block's (`toolu_...`)."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish_reason: str) -> StopReason:
    """Chat's finish reason as Anthropic's. The engine does not say whether a stop sequence or the
    model's end token ended the answer: both are `end_turn`."""
    return STOP_REASONS.get(finish_reason, "end_turn")


def usage_of(chat_usage: dict[str, Any]) -> dict[str, int]:
    """Anthropic's usage: the prompt split into tokens read from the cache, tokens written to it
    (the tool group a miss computed and stored) and the rest (`input_tokens`)."""
    details = chat_usage.get("prompt_tokens_details") or {}
    read, written = details.get("cached_tokens", 0), details.get("cache_write_tokens", 0)
    return {"input_tokens": max(chat_usage["prompt_tokens"] - read - written, 0),
            "output_tokens": chat_usage["completion_tokens"],
            "cache_creation_input_tokens": written, "cache_read_input_tokens": read}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as a tool_use block's `input` (a call `max_tokens` cut short: `{}`)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_of(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as content blocks: its text (if any), then one tool_use per call."""
    blocks = [text_block(message["content"])] if message.get("content") else []
    for call in message.get("tool_calls") or ():
        function = call["function"]
        blocks.append(tool_use_block(call["id"], function["name"], tool_input(function["arguments"])))
    return blocks


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def tool_use_block(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_use_id(call_id), "name": name, "input": arguments}


def message_body(message_id: str, model: str, content: list[dict[str, Any]], reason: StopReason | None,
                 usage: dict[str, int]) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "content": content, "model": model,
            "stop_reason": reason, "stop_sequence": None, "usage": usage}


# ---- streamed --------------------------------------------------------------------------------


class MessageEvents:
    """Chat chunks in (`feed`), Messages events out; `finish` or `fail` ends the message."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self.blocks = 0  # content blocks opened so far (the open one is the last)
        self.open: Literal["text", "tool_use"] | None = None
        self.finish_reason = "stop"
        self.chat_usage: dict[str, Any] | None = None

    def start(self, usage: dict[str, int]) -> list[dict[str, Any]]:
        """`usage`: the prompt's, known once the first chunk is in hand (output_tokens 0)."""
        message = message_body(self.message_id, self.model, [], None, usage)
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if chunk.get("usage") is not None:
            self.chat_usage = chunk["usage"]
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._write_text(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._write_call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self, usage: dict[str, int]) -> list[dict[str, Any]]:
        """The closing events; `usage`: the whole answer's."""
        events = self._close()
        events.append({"type": "message_delta", "delta": {"stop_reason": stop_reason(self.finish_reason),
                                                          "stop_sequence": None}, "usage": usage})
        events.append({"type": "message_stop"})
        return events

    @staticmethod
    def fail(message: str, status: int) -> list[dict[str, Any]]:
        return [error_body(message, status)]

    # ---- blocks --------------------------------------------------------------------------

    def _write_text(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open != "text":
            events += self._close() + self._start(text_block(""), "text")
        events.append(self._delta({"type": "text_delta", "text": text}))
        return events

    def _write_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        function = call.get("function") or {}
        if "id" in call:  # a call's first delta: a new block
            events += self._close() + self._start(tool_use_block(call["id"], function.get("name", ""), {}),
                                                  "tool_use")
        fragment = function.get("arguments") or ""
        if fragment and self.open == "tool_use":
            events.append(self._delta({"type": "input_json_delta", "partial_json": fragment}))
        return events

    def _start(self, block: dict[str, Any], kind: Literal["text", "tool_use"]) -> list[dict[str, Any]]:
        self.open = kind
        self.blocks += 1
        return [{"type": "content_block_start", "index": self.blocks - 1, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.blocks - 1}]
