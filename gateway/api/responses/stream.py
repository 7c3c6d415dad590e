"""The Responses API's streaming events, from the chat service's stream chunks.

A small state machine: content deltas write a `message` item (opened with
`response.output_item.added` and `response.content_part.added`, written with
`response.output_text.delta`, closed with `...output_text.done`, `...content_part.done`,
`...output_item.done`; each delta carries the logprobs, when asked, of the tokens the chat
chunk sent with its text, and entries a chunk sent without text join the next delta, or else the
`.done` event); a tool call's first delta opens a `function_call` item, its argument
fragments are `response.function_call_arguments.delta`, and it closes with
`...function_call_arguments.done` and `...output_item.done`. An item closes when the next one
opens or the stream ends. Events are numbered from 0 (`sequence_number`), as OpenAI numbers them:
`response.created` and `response.in_progress` first, then the items, then
`response.completed` (`response.incomplete` when `max_output_tokens` cut it short), or `error`
and `response.failed`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.protocol.responses_output import (
    ItemStatus,
    ResponseShape,
    function_call_item,
    message_item,
    new_item_id,
    status_of,
    text_part,
)


@dataclass(slots=True)
class _TextItem:
    item_id: str
    parts: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # its tokens' entries, when asked

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def item(self, status: ItemStatus) -> dict[str, Any]:
        return message_item(self.item_id, None if status == "in_progress" else self.text, status, self.logprobs)


@dataclass(slots=True)
class _CallItem:
    item_id: str
    call_id: str
    name: str
    fragments: list[str] = field(default_factory=list)

    @property
    def arguments(self) -> str:
        return "".join(self.fragments)

    def item(self, status: ItemStatus) -> dict[str, Any]:
        arguments = "" if status == "in_progress" else self.arguments
        return function_call_item(self.item_id, self.call_id, self.name, arguments, status)


class ResponseEvents:
    """Chat chunks in (`feed`), Responses events out; `finish` or `fail` ends the response."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # closed items, in output order
        self.text: _TextItem | None = None  # the open message item
        self.call: _CallItem | None = None  # the open function_call item
        self.loose: list[dict[str, Any]] = []  # text tokens' logprobs a chunk sent without text
        self.finish_reason = "stop"
        self.chat_usage: dict[str, Any] | None = None

    def start(self) -> list[dict[str, Any]]:
        body = self.shape.body("in_progress", [], None)
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if chunk.get("usage") is not None:
            self.chat_usage = chunk["usage"]
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            entries = (choice.get("logprobs") or {}).get("content") or []
            if delta.get("content"):
                events += self._write_text(delta["content"], entries)
            elif self.call is None and not delta.get("tool_calls"):
                self.loose += entries  # tokens that wrote no text yet (held back, or the end token)
            for call in delta.get("tool_calls") or ():
                events += self._write_call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self, usage: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events and the final response body."""
        status = status_of(self.finish_reason)
        events = self._open_text() if not self.output and self.call is None else []  # an empty answer
        events += self._close(status)
        body = self.shape.body(status, self.output, usage)
        events.append(self._event(f"response.{status}", response=body))
        return events, body

    def fail(self, message: str, code: str | None) -> list[dict[str, Any]]:
        error = self._event("error", code=code, message=message, param=None)
        body = self.shape.body("failed", self.output, None, error={"code": "server_error", "message": message})
        return [error, self._event("response.failed", response=body)]

    # ---- items ---------------------------------------------------------------------------

    def _write_text(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events = self._close_call() + self._open_text()
        assert self.text is not None
        logprobs, self.loose = self.loose + logprobs, []
        self.text.parts.append(text)
        self.text.logprobs += logprobs
        events.append(self._text_event("response.output_text.delta", delta=text, logprobs=logprobs))
        return events

    def _open_text(self) -> list[dict[str, Any]]:
        if self.text is not None:
            return []
        self.text = _TextItem(new_item_id("msg"))
        return [self._event("response.output_item.added", output_index=len(self.output),
                            item=self.text.item("in_progress")),
                self._part_event("response.content_part.added", text_part(""))]

    def _write_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        function = call.get("function") or {}
        if "id" in call:  # a call's first delta: a new item
            events += self._close("completed")
            self.call = _CallItem(new_item_id("fc"), call["id"], function.get("name", ""))
            events.append(self._event("response.output_item.added", output_index=len(self.output),
                                      item=self.call.item("in_progress")))
        fragment = function.get("arguments") or ""
        if fragment and self.call is not None:
            self.call.fragments.append(fragment)
            events.append(self._event("response.function_call_arguments.delta", item_id=self.call.item_id,
                                      output_index=len(self.output), delta=fragment))
        return events

    def _close(self, status: ItemStatus) -> list[dict[str, Any]]:
        return self._close_text(status) + self._close_call()

    def _close_text(self, status: ItemStatus) -> list[dict[str, Any]]:
        if self.text is None:
            return []
        self.text.logprobs += self.loose
        self.loose = []
        text, logprobs = self.text.text, self.text.logprobs
        events = [self._text_event("response.output_text.done", text=text, logprobs=logprobs),
                  self._part_event("response.content_part.done", text_part(text, logprobs)),
                  self._event("response.output_item.done", output_index=len(self.output),
                              item=self.text.item(status))]
        self.output.append(self.text.item(status))
        self.text = None
        return events

    def _close_call(self) -> list[dict[str, Any]]:
        if self.call is None:
            return []
        call, index = self.call, len(self.output)
        events = [self._event("response.function_call_arguments.done", item_id=call.item_id, output_index=index,
                              arguments=call.arguments),
                  self._event("response.output_item.done", output_index=index, item=call.item("completed"))]
        self.output.append(call.item("completed"))
        self.call = None
        return events

    # ---- events --------------------------------------------------------------------------

    def _text_event(self, kind: str, **fields: Any) -> dict[str, Any]:
        assert self.text is not None
        return self._event(kind, item_id=self.text.item_id, output_index=len(self.output), content_index=0,
                           **fields)

    def _part_event(self, kind: str, part: dict[str, Any]) -> dict[str, Any]:
        assert self.text is not None
        return self._event(kind, item_id=self.text.item_id, output_index=len(self.output), content_index=0,
                           part=part)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event
