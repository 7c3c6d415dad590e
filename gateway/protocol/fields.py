"""What every API's wire models share (chat.py, responses.py, messages.py, completions.py): the
strict-but-lenient base model, the errors a validator raises to name a field, the field types and
checks more than one API uses, and `SamplingFields`, the fields chat and legacy completions share."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from gateway.protocol.generation import Sampling

MAX_TOKENS_LIMIT = 2**31 - 1
MAX_TOP_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGIT_BIAS = 100.0
PROMPT_CACHE_RETENTION_S = 24 * 3600.0  # prompt_cache_retention "24h"
MAX_TOKEN_ID_DIGITS = 20  # no vocabulary is near 10**20 tokens; longer keys would not even parse as an int


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


class StreamOptions(Lenient):
    include_usage: bool = False


class SamplingFields(Lenient):
    """The fields chat and legacy completions share: the model, sampling, stops, streaming and
    the cache hints, validated the same way for both."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)  # 0: the likeliest token alone, as OpenAI allows
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # OpenAI's seed is an int64
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    prompt_cache_key: str | None = None  # accepted; routes the request in proxy mode and the fleet
    # "24h": the tool group stays cached at least a day (not evicted by LRU); "in_memory": plain LRU
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    user: str | None = None
    safety_identifier: str | None = Field(None, max_length=64)  # as `user`: for the caller's own records
    metadata: Metadata | None = None  # OpenAI keeps it with stored objects: none here
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # Fields not implemented, each with the values that ask for nothing (accepted): a 400 otherwise
    unsupported: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _unsupported_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, is_noop in cls.unsupported.items():
                value = data.get(name)
                if value is not None and not is_noop(value):
                    raise UnsupportedField(name)
        return data

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        return check_logit_bias(bias)

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError("only n=1 is supported")
        return n

    _options_need_a_stream = field_validator("stream_options")(options_need_a_stream)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop sequences")
        return stop

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        """The stop strings (an empty one stops nothing: it is dropped)."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return tuple(s for s in stops if s)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def retention_s(self) -> float:
        """How long the tool group is kept at least (0: LRU alone decides)."""
        return PROMPT_CACHE_RETENTION_S if self.prompt_cache_retention == "24h" else 0.0

    def sampling(self, *, logprobs: bool = False, top_logprobs: int = 0) -> Sampling:
        return Sampling(temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop=self.stop_sequences,
                        frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                        logit_bias=self.logit_bias, logprobs=logprobs, top_logprobs=top_logprobs)


def check_logit_bias(bias: dict[str, float] | None) -> dict[str, float] | None:
    """`logit_bias` keys are token ids written in decimal, values in [-100, 100] (as OpenAI); whether
    an id exists in this model's vocabulary is checked by the service."""
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise ValueError(f"the key '{key[:20]}' is not a token id (token ids are written as \"1234\")")
        if len(key) > MAX_TOKEN_ID_DIGITS:
            raise ValueError(f"the key '{key[:20]}...' has {len(key)} digits: no model has a token id that large")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(f"the bias of token {key} is {value}; biases are from -100 to 100")
    return bias
