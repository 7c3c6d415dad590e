"""What every API's wire models share (chat.py, responses.py, messages.py, completions.py): the
strict-but-lenient base model, the errors a validator raises to name a field, and the field types
and checks more than one API uses."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo

MAX_TOKENS_LIMIT = 2**31 - 1
MAX_TOP_LOGPROBS = 20


class Lenient(BaseModel):
    """Unknown keys are ignored (vendor extras); known keys are typed strictly. The base of every
    wire model here and in responses.py and messages.py."""

    model_config = ConfigDict(extra="ignore", strict=True)


class UnsupportedField(ValueError):
    """An OpenAI request field toolkv does not implement, holding a value that would matter."""

    def __init__(self, field: str) -> None:
        super().__init__(f"'{field}' is not supported by this server")
        self.field = field


class InvalidValue(ValueError):
    """A field whose value is wrong in a way its type cannot say (a repeated id): a 400 naming it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class UnsupportedValue(UnsupportedField):
    """A known field holding a value toolkv does not implement (a hosted tool, an image part)."""

    def __init__(self, field: str, message: str) -> None:
        ValueError.__init__(self, message)
        self.field = field


def _object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters: arguments are a JSON object, so a schema that names another type
    has no valid call (OpenAI answers 400 too); one that names no type is read as an object's."""
    kind = schema.get("type", "object")
    if kind != "object":
        raise ValueError(f"a function's parameters must be a JSON Schema of type 'object' (its arguments "
                         f"are a JSON object), not type {json.dumps(kind)[:80]}")
    return schema


ObjectSchema = Annotated[dict[str, Any], AfterValidator(_object_schema)]
# OpenAI's metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]


def bracketed_type(value: Any) -> str | None:
    """A `type`-told union's tag, bracketed: pydantic puts the tag in an error's location, and
    `param_path` leaves out bracketed parts, so the error names `text.format.name`, not
    `text.format.json_schema.name` (a field no client sent)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"[{kind}]" if isinstance(kind, str) else None


def options_need_a_stream(options: Any, info: ValidationInfo) -> Any:
    """`stream_options` only with `stream: true` (as OpenAI answers); a `stream_options` validator
    of chat, completions and Responses (declared after `stream`)."""
    if options is not None and not info.data.get("stream"):
        raise ValueError("'stream_options' is only allowed when 'stream' is true")
    return options


def implicit_caching(options: Any) -> bool:
    """`prompt_cache_options` that ask for what toolkv does anyway (OpenAI's defaults): an implicit
    cache of every prompt. Explicit breakpoints, or another lifetime, it does not implement."""
    return isinstance(options, dict) and set(options) <= {"mode", "ttl"} \
        and options.get("mode", "implicit") == "implicit" and options.get("ttl", "30m") == "30m"
