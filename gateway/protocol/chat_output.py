"""The chat-completions answer on the wire: ids, `usage`, a whole completion, a stream chunk (and
the legacy `function_call` shape for requests that asked with `functions`), the model list."""

from __future__ import annotations

import time
import uuid
from typing import Any


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               cache_write_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage: cache reads (`cached_tokens`) and writes (`cache_write_tokens`) apart."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": cache_write_tokens},
    }


def completion_dict(
    completion_id: str,
    model: str,
    message: dict[str, Any],
    finish_reason: str,
    usage: dict[str, Any],
    system_fingerprint: str | None = None,
    logprobs: dict[str, Any] | None = None,
    legacy_functions: bool = False,
) -> dict[str, Any]:
    if legacy_functions:
        message, finish_reason = _as_function_call(message), _legacy_finish(finish_reason)
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}],
        "usage": usage,
        "system_fingerprint": system_fingerprint,
    }


def chunk_dict(
    completion_id: str,
    created: int,
    model: str,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    usage: dict[str, Any] | None = None,
    system_fingerprint: str | None = None,
    logprobs: dict[str, Any] | None = None,
    legacy_functions: bool = False,
) -> dict[str, Any]:
    if legacy_functions and delta is not None:
        delta, finish_reason = _as_function_call(delta), finish_reason and _legacy_finish(finish_reason)
    choices = [] if delta is None else [
        {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    ]
    chunk: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": system_fingerprint,
    }
    if usage is not None:
        chunk["usage"] = usage
    return chunk


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
