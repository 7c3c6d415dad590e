"""The chat-completions answer on the wire: ids, `usage`, a whole completion, the stream's chunks
(and the legacy `function_call` shape for requests that asked with `functions`), the model list;
built from the typed answer (answer.py)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from gateway.protocol.answer import (
    Answer,
    AnswerEvent,
    CallArguments,
    CallStarted,
    Logprobs,
    Started,
    TextWritten,
    ToolCall,
    Usage,
)


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def usage_dict(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage: cache reads (`cached_tokens`) and writes (`cache_write_tokens`) apart."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens,
                                  "cache_write_tokens": usage.cache_write_tokens},
    }


def completion_dict(completion_id: str, model: str, answer: Answer, system_fingerprint: str | None = None,
                    legacy_functions: bool = False) -> dict[str, Any]:
    """A whole answer as a `chat.completion`."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.content, "refusal": None}
    if answer.tool_calls:
        message["tool_calls"] = [_call(call) for call in answer.tool_calls]
    finish_reason: str = answer.finish_reason
    if legacy_functions:
        message, finish_reason = _as_function_call(message), _legacy_finish(finish_reason)
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": _logprobs(answer.logprobs),
                     "finish_reason": finish_reason}],
        "usage": usage_dict(answer.usage),
        "system_fingerprint": system_fingerprint,
    }


class ChatChunks:
    """A streamed answer's events as `chat.completion.chunk`s: the assistant role first (content
    null when a forced call makes the answer only calls), then content and tool-call deltas, one
    chunk with the finish reason, and with `include_usage` a last chunk with the usage."""

    def __init__(self, completion_id: str, model: str, system_fingerprint: str | None = None, *,
                 include_usage: bool = False, legacy_functions: bool = False) -> None:
        self.completion_id = completion_id
        self.model = model
        self.created = int(time.time())
        self.system_fingerprint = system_fingerprint
        self.include_usage = include_usage
        self.legacy_functions = legacy_functions

    def of(self, event: AnswerEvent) -> list[dict[str, Any]]:
        if isinstance(event, Started):
            return [self._chunk({"role": "assistant", "content": None if event.forced_call else ""})]
        if isinstance(event, TextWritten):
            return [self._chunk({"content": event.text}, logprobs=event.logprobs)]
        if isinstance(event, CallStarted):
            call = {"index": event.index, "id": event.call_id, "type": "function",
                    "function": {"name": event.name, "arguments": ""}}
            return [self._chunk({"tool_calls": [call]}, logprobs=event.logprobs)]
        if isinstance(event, CallArguments):
            call = {"index": event.index, "function": {"arguments": event.fragment}}
            return [self._chunk({"tool_calls": [call]}, logprobs=event.logprobs)]
        chunks = [self._chunk({}, finish_reason=event.finish_reason, logprobs=event.logprobs)]
        if self.include_usage:
            chunks.append(self._chunk(None, usage=usage_dict(event.usage)))
        return chunks

    def _chunk(self, delta: dict[str, Any] | None, finish_reason: str | None = None,
               usage: dict[str, Any] | None = None, logprobs: Logprobs = None) -> dict[str, Any]:
        if self.legacy_functions and delta is not None:
            delta, finish_reason = _as_function_call(delta), finish_reason and _legacy_finish(finish_reason)
        choices = [] if delta is None else [
            {"index": 0, "delta": delta, "logprobs": _logprobs(logprobs), "finish_reason": finish_reason}
        ]
        chunk: dict[str, Any] = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": self.system_fingerprint,
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk


def _call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _logprobs(entries: Logprobs) -> dict[str, Any] | None:
    return None if entries is None else {"content": entries, "refusal": None}


def _as_function_call(message: dict[str, Any]) -> dict[str, Any]:
    """A message or delta with `tool_calls` as the legacy `function_call` (its one call; a legacy
    request allows one): `{name, arguments}` whole, or in a delta the name first, then fragments."""
    if "tool_calls" not in message:
        return message
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    function = message["tool_calls"][0]["function"]
    out["function_call"] = {k: function[k] for k in ("name", "arguments") if k in function}
    return out


def _legacy_finish(finish_reason: str) -> str:
    return "function_call" if finish_reason == "tool_calls" else finish_reason


def model_list(model_id: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                        "owned_by": "toolkv"}]}
