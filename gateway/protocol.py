"""The OpenAI chat-completions wire format: request validation at the edge, response builders.

Types are strict at the edge: a string is not a number and a number is not a boolean
(`"max_tokens": "5"` and `"stream": "yes"` are 400s that name the field, not coerced). Integers are
range-checked before they reach torch. OpenAI fields toolkv does not implement are a 400 naming
the field unless they hold their no-op default (`"logprobs": false`, `"frequency_penalty": 0`):
a client never gets a 200 that silently ignored what it asked for. Fields outside OpenAI's API
(vendor extras some clients send) are ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from adapters.base import FUNCTION_NAME_PATTERN, ChatMessage, ToolCallIn, ToolSpec

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOKENS_LIMIT = 2**31 - 1


class _Lenient(BaseModel):
    """Unknown keys are ignored (vendor extras); known keys are typed strictly."""

    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallWire(_Lenient):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class MessageIn(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallWire] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> MessageIn:
        if self.content is None and not (self.role == "assistant"):
            raise ValueError(f"a '{self.role}' message needs 'content'")
        return self

    def to_chat(self) -> ChatMessage:
        calls = tuple(
            ToolCallIn(id=c.id, name=c.function.name, arguments=_args_text(c.function.arguments))
            for c in self.tool_calls or ()
        )
        role = "system" if self.role == "developer" else self.role
        return ChatMessage(role=role, content=_text_of(self.content), tool_calls=calls,
                           tool_call_id=self.tool_call_id, name=self.name)


class FunctionSpecIn(_Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=FUNCTION_NAME_PATTERN)  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolIn(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionSpecIn

    def to_spec(self) -> ToolSpec:
        return ToolSpec(name=self.function.name, description=self.function.description,
                        parameters=self.function.parameters)


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    """`text` (no constraint), `json_object` (any JSON object) or `json_schema` (valid for it)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a 'json_schema' response_format needs 'json_schema'")
        return self

    @property
    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer must be valid for; None for plain text."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema" and self.json_schema is not None:
            return self.json_schema.schema_
        return None


class StreamOptions(_Lenient):
    include_usage: bool = False


class UnsupportedField(ValueError):
    """An OpenAI request field toolkv does not implement, holding a value that would matter."""

    def __init__(self, field: str) -> None:
        super().__init__(f"'{field}' is not supported by this server")
        self.field = field


# OpenAI fields that are not implemented, each with the values that ask for nothing (accepted).
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "logprobs": lambda v: v is False,
    "top_logprobs": lambda v: v == 0 and not isinstance(v, bool),
    "frequency_penalty": lambda v: v == 0 and not isinstance(v, bool),
    "presence_penalty": lambda v: v == 0 and not isinstance(v, bool),
    "logit_bias": lambda v: v == {},
    "functions": lambda v: False,
    "function_call": lambda v: False,
    "audio": lambda v: False,
    "modalities": lambda v: v == ["text"],
    "prediction": lambda v: False,
    "web_search_options": lambda v: False,
    "reasoning_effort": lambda v: False,
    "verbosity": lambda v: False,
    "moderation": lambda v: False,
    "store": lambda v: v is False,
    "service_tier": lambda v: v in ("auto", "default"),
}


class ChatCompletionRequest(_Lenient):
    model: str | None = None
    messages: list[MessageIn] = Field(min_length=1)
    tools: list[ToolIn] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # OpenAI's seed is an int64
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    n: int | None = None
    prompt_cache_key: str | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, is_noop in UNSUPPORTED_FIELDS.items():
                value = data.get(name)
                if value is not None and not is_noop(value):
                    raise UnsupportedField(name)
        return data

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop sequences")
        return stop

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _text_of(content: str | list[TextPart] | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def _args_text(arguments: str | dict[str, Any]) -> str:
    if isinstance(arguments, str):
        return arguments
    import json

    return json.dumps(arguments, ensure_ascii=False)


# ---- responses ---------------------------------------------------------------------------


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_dict(
    completion_id: str,
    model: str,
    message: dict[str, Any],
    finish_reason: str,
    usage: dict[str, Any],
    system_fingerprint: str | None = None,
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
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
) -> dict[str, Any]:
    choices = [] if delta is None else [
        {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
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


def model_list(model_id: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                        "owned_by": "toolkv"}]}
