"""The Responses API's streaming events, from the answer's events (gateway/protocol/answer.py).

A small state machine: written text makes a `message` item (opened with
`response.output_item.added` and `response.content_part.added`, written with
`response.output_text.delta`, closed with `...output_text.done`, `...content_part.done`,
`...output_item.done`; each delta carries the logprobs, when asked, of the tokens the answer
event sent with its text, and entries the answer's end carried join the `.done` event); a
started call opens a `function_call` item, its argument
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

from gateway.errors import APIError
from gateway.protocol.answer import CallArguments, CallStarted, Ended, Started, TextWritten
from gateway.protocol.responses_output import (
    ItemStatus,
    ResponseShape,
    function_call_item,
    message_item,
    new_item_id,
    status_of,
    text_part,
    usage_of,
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
    """Answer events in (`feed`, then `finish` with the `Ended`), Responses events out; `fail`
    ends the response early."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # closed items, in output order
        self.text: _TextItem | None = None  # the open message item
        self.call: _CallItem | None = None  # the open function_call item

    def feed(self, event: Started | TextWritten | CallStarted | CallArguments) -> list[dict[str, Any]]:
        if isinstance(event, Started):
            body = self.shape.body("in_progress", [], None)
            return [self._event("response.created", response=body),
                    self._event("response.in_progress", response=body)]
        if isinstance(event, TextWritten):
            return self._write_text(event.text, event.logprobs or [])
        if isinstance(event, CallStarted):
            events = self._close("completed")
            self.call = _CallItem(new_item_id("fc"), event.call_id, event.name)
            events.append(self._event("response.output_item.added", output_index=len(self.output),
                                      item=self.call.item("in_progress")))
            return events
        if not event.fragment or self.call is None:
            return []
        self.call.fragments.append(event.fragment)
        return [self._event("response.function_call_arguments.delta", item_id=self.call.item_id,
                            output_index=len(self.output), delta=event.fragment)]

    def finish(self, end: Ended) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events and the final response body."""
        status = status_of(end.finish_reason)
        events = self._open_text() if not self.output and self.call is None else []  # an empty answer
        if self.text is not None:  # the entries of tokens no text event carried (the end token's)
            self.text.logprobs += end.logprobs or []
        events += self._close(status)
        body = self.shape.body(status, self.output, usage_of(end.usage))
        events.append(self._event(f"response.{status}", response=body))
        return events, body

    def fail(self, error: APIError) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The `error` event and `response.failed` for `error` (already in Responses terms), and
        the failed response's body. The event carries the error as a whole answer would (its code,
        else its type, and the field it names); the body's code is one of OpenAI's response error
        codes: `invalid_prompt` for what the request asked, `server_error` for the rest."""
        event = self._event("error", code=error.code or error.error_type, message=error.message, param=error.param)
        failed_code = "invalid_prompt" if error.status_code < 500 else "server_error"
        body = self.shape.body("failed", self.output, None, error={"code": failed_code, "message": error.message})
        return [event, self._event("response.failed", response=body)], body

    # ---- items ---------------------------------------------------------------------------

    def _write_text(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events = self._close_call() + self._open_text()
        assert self.text is not None
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

    def _close(self, status: ItemStatus) -> list[dict[str, Any]]:
        """Close the open item (at most one is: text and a call close each other) as `status`."""
        return self._close_text(status) + self._close_call(status)

    def _close_text(self, status: ItemStatus) -> list[dict[str, Any]]:
        if self.text is None:
            return []
        text, logprobs = self.text.text, self.text.logprobs
        events = [self._text_event("response.output_text.done", text=text, logprobs=logprobs),
                  self._part_event("response.content_part.done", text_part(text, logprobs)),
                  self._event("response.output_item.done", output_index=len(self.output),
                              item=self.text.item(status))]
        self.output.append(self.text.item(status))
        self.text = None
        return events

    def _close_call(self, status: ItemStatus = "completed") -> list[dict[str, Any]]:
        if self.call is None:
            return []
        call, index = self.call, len(self.output)
        events = [self._event("response.function_call_arguments.done", item_id=call.item_id, output_index=index,
                              arguments=call.arguments),
                  self._event("response.output_item.done", output_index=index, item=call.item(status))]
        self.output.append(call.item(status))
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
