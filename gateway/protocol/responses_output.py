"""The Responses API's response objects: output items (`message` with `output_text` parts,
`function_call`), usage, and the response itself with the request's settings echoed, built
from the typed answer (answer.py), whole or as its stream's events."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from gateway.protocol.answer import Answer, Usage
from gateway.protocol.responses import ResponsesRequest

ItemStatus = Literal["in_progress", "completed", "incomplete"]


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An `output_text` part; `logprobs`: its tokens' entries, in chat's shape (OpenAI's here too)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(item_id: str, text: str | None, status: ItemStatus,
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An assistant message; `text` None while it is being written (no part yet)."""
    content = [] if text is None else [text_part(text, logprobs)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: ItemStatus) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def status_of(finish_reason: str) -> Literal["completed", "incomplete"]:
    return "incomplete" if finish_reason == "length" else "completed"


def output_of(answer: Answer) -> list[dict[str, Any]]:
    """A whole answer as output items: its text (if any, or if there is nothing else), then one
    `function_call` item per call. An answer `max_output_tokens` cut short has its last item
    `incomplete` (a call's arguments cut mid-way are not JSON); the items before it are whole."""
    text, calls = answer.content or "", answer.tool_calls
    entries = text_logprobs(answer.logprobs or [], text, bool(calls))
    items = []
    last = status_of(answer.finish_reason)
    if text or not calls:
        items.append(message_item(new_item_id("msg"), text, last if not calls else "completed", entries))
    for index, call in enumerate(calls):
        status: ItemStatus = last if index == len(calls) - 1 else "completed"
        items.append(function_call_item(new_item_id("fc"), call.call_id, call.name, call.arguments, status))
    return items


def text_logprobs(entries: list[dict[str, Any]], text: str, calls: bool) -> list[dict[str, Any]]:
    """The entries of the tokens that wrote `text`: every one of a text answer (as chat's), the
    leading ones that spell the text when calls follow it (the calls' tokens are not text)."""
    if not calls:
        return entries
    left, kept = len(text.encode()), []
    for entry in entries:
        if left <= 0:
            break
        kept.append(entry)
        left -= len(entry["bytes"])
    return kept


def assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as the chat message a follow-up request renders for this turn."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    turn: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def usage_of(usage: Usage) -> dict[str, Any]:
    """An answer's usage in the Responses shape (cache reads and writes as chat counts them)."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": usage.cache_write_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """What a response object says before its output exists: its id and the request's settings."""

    response_id: str
    created_at: int
    model: str
    echo: dict[str, Any]

    @classmethod
    def of(cls, response_id: str, req: ResponsesRequest, model: str) -> ResponseShape:
        return cls(response_id, int(time.time()), model, _echo(req))

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model, "output": output, "usage": usage, **self.echo,
        }


def _echo(req: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as OpenAI echoes them, defaults filled in."""
    choice = req.tool_choice
    tools = [tool.model_dump() for tool in req.tools or ()]
    return {
        "background": False, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls, "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "prompt_cache_key": req.prompt_cache_key,
        "reasoning": {"effort": None, "summary": None}, "safety_identifier": req.safety_identifier,
        "service_tier": "default", "store": req.store is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": req.format.model_dump(by_alias=True, exclude_none=True), "verbosity": "medium"},
        "tool_choice": choice.model_dump() if isinstance(choice, BaseModel) else choice or "auto",
        "tools": tools, "top_logprobs": req.top_logprobs or 0, "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled", "user": req.user,
    }
