"""The OpenAI chat-completions wire format: request validation at the edge, response builders.

Types are strict at the edge: a string is not a number and a number is not a boolean
(`"max_tokens": "5"` and `"stream": "yes"` are 400s that name the field, not coerced). Integers are
range-checked before they reach torch. OpenAI fields toolkv does not implement are a 400 naming
the field unless they hold their no-op default (`"store": false`, `"modalities": ["text"]`):
a client never gets a 200 that silently ignored what it asked for. Fields outside OpenAI's API
(vendor extras some clients send) are ignored.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from adapters.base import FUNCTION_NAME_PATTERN, ChatMessage, ToolCallIn, ToolSpec
from gateway.protocol import generation
from gateway.protocol.fields import (
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
    Lenient,
    ObjectSchema,
    SamplingFields,
    UnsupportedValue,
    implicit_caching,
)
from gateway.protocol.generation import CHAT_FIELDS, FUNCTIONS_FIELDS, FieldNames, GenerationRequest


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class FunctionCallIn(Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallWire(Lenient):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class MessageIn(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallWire] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCallIn | None = None  # legacy: an assistant's call, before tool_calls

    @model_validator(mode="after")
    def _content_required(self) -> MessageIn:
        if self.content is None and not (self.role == "assistant"):
            raise ValueError(f"a '{self.role}' message needs 'content'")
        if self.role == "tool" and self.tool_call_id is None:  # OpenAI's rule; "function" results carry `name`
            raise ValueError("a 'tool' message needs 'tool_call_id': the id of the call it answers")
        return self

    def to_chat(self) -> ChatMessage:
        calls = tuple(
            ToolCallIn(id=c.id, name=c.function.name, arguments=_args_text(c.function.arguments))
            for c in self.tool_calls or ()
        )
        if self.function_call is not None:  # legacy functions: the call, and ("function") its result
            calls += (ToolCallIn(id="", name=self.function_call.name,
                                 arguments=_args_text(self.function_call.arguments)),)
        role = {"developer": "system", "function": "tool"}.get(self.role, self.role)
        return ChatMessage(role=role, content=_text_of(self.content), tool_calls=calls,
                           tool_call_id=self.tool_call_id, name=self.name)


class FunctionSpecIn(Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=FUNCTION_NAME_PATTERN)  # OpenAI's rule
    description: str | None = None
    parameters: ObjectSchema | None = None
    strict: bool | None = None


class ToolIn(Lenient):
    type: Literal["function"] = "function"
    function: FunctionSpecIn

    def to_spec(self) -> ToolSpec:
        return ToolSpec(name=self.function.name, description=self.function.description,
                        parameters=self.function.parameters)


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class AllowedTool(Lenient):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(Lenient):
    mode: Literal["auto", "required"]
    tools: list[AllowedTool] = Field(min_length=1)


class AllowedToolsChoice(Lenient):
    """Calls restricted to a subset of `tools`, which are all still rendered into the prompt (so the
    tool group, and its cached KV, is the same whatever the subset)."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools

    @property
    def names(self) -> frozenset[str]:
        return frozenset(tool.function.name for tool in self.allowed_tools.tools)


def _choice_kind(value: Any) -> str:
    if isinstance(value, str):
        return "Mode"
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "AllowedTools" if kind == "allowed_tools" else "Named"


# Tags start with a capital so error locations name the field, not the union member.
ToolChoice = Annotated[Annotated[Literal["none", "auto", "required"], Tag("Mode")]
                       | Annotated[NamedToolChoice, Tag("Named")]
                       | Annotated[AllowedToolsChoice, Tag("AllowedTools")], Discriminator(_choice_kind)]


class JsonSchemaFormat(Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
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


# OpenAI fields that are not implemented, each with the values that ask for nothing (accepted).
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "audio": lambda v: False,
    "modalities": lambda v: v == ["text"],
    "prediction": lambda v: False,
    "web_search_options": lambda v: False,
    "reasoning_effort": lambda v: False,
    "verbosity": lambda v: v == "medium",  # OpenAI's default (Responses accepts it too)
    "moderation": lambda v: False,
    "store": lambda v: v is False,
    "service_tier": lambda v: v in ("auto", "default"),
    "prompt_cache_options": implicit_caching,
}


class ChatCompletionRequest(SamplingFields):
    unsupported: ClassVar[dict[str, Any]] = UNSUPPORTED_FIELDS

    messages: list[MessageIn] = Field(min_length=1)
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Legacy function calling, served as `tools` / `tool_choice` (see `_legacy_functions`).
    functions: list[FunctionSpecIn] | None = Field(None, min_length=1, max_length=128)
    function_call: Literal["none", "auto"] | NamedFunction | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        """Content parts this server reads: text, and an assistant's refusal (read as its text).
        An image, audio or file part is a 400 naming it, not a type error about strings."""
        messages = data.get("messages") if isinstance(data, dict) else None
        for index, message in enumerate(messages if isinstance(messages, list) else ()):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                continue
            for p_index, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "refusal" and message.get("role") == "assistant" and isinstance(part.get("refusal"), str):
                    content[p_index] = {"type": "text", "text": part["refusal"]}
                elif kind != "text" and isinstance(kind, str):
                    raise UnsupportedValue(f"messages[{index}].content[{p_index}].type",
                                           f"content parts of type '{kind[:40]}' are not supported: this server "
                                           "reads text parts only")
        return data

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):  # as OpenAI: asking for alternatives needs logprobs on
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        return top

    @field_validator("functions")
    @classmethod
    def _functions_or_tools(cls, functions: list[FunctionSpecIn] | None,
                            info: ValidationInfo) -> list[FunctionSpecIn] | None:
        if functions is not None and info.data.get("tools") is not None:
            raise ValueError("send 'tools' or the deprecated 'functions', not both")
        names = [f.name for f in functions or ()]
        if len(set(names)) < len(names):
            raise ValueError("two functions have the same name")
        return functions

    @field_validator("function_call")
    @classmethod
    def _function_call(cls, choice: Literal["none", "auto"] | NamedFunction | None,
                       info: ValidationInfo) -> Literal["none", "auto"] | NamedFunction | None:
        if choice is not None and info.data.get("tool_choice") is not None:
            raise ValueError("send 'tool_choice' or the deprecated 'function_call', not both")
        names = {f.name for f in info.data.get("functions") or ()}
        if isinstance(choice, NamedFunction) and choice.name not in names:
            raise ValueError(f"names the function '{choice.name}', which is not in 'functions'")
        return choice

    @model_validator(mode="after")
    def _legacy_functions(self) -> ChatCompletionRequest:
        """`functions` served as `tools`, `function_call` as `tool_choice` (one call at most: a
        legacy response has one `function_call`)."""
        if self.functions is None:
            return self
        self.tools = [ToolIn(function=f) for f in self.functions]
        choice = self.function_call
        self.tool_choice = NamedToolChoice(function=choice) if isinstance(choice, NamedFunction) else choice
        self.parallel_tool_calls = False
        return self

    @property
    def legacy_functions(self) -> bool:
        """Asked with `functions`: the answer carries `function_call`, not `tool_calls`."""
        return self.functions is not None

    def to_generation(self, fields: FieldNames | None = None) -> GenerationRequest:
        """This request as the service takes it. `fields`: where its fields are (default: chat's,
        a legacy request's `functions` and `function_call`)."""
        if fields is None:
            fields = FUNCTIONS_FIELDS if self.legacy_functions else CHAT_FIELDS
            if self.max_completion_tokens:
                fields = dataclasses.replace(fields, max_tokens="max_completion_tokens")
        answer = self.response_format.answer_schema if self.response_format is not None else None
        return GenerationRequest(
            messages=tuple(m.to_chat() for m in self.messages), tools=tuple(t.to_spec() for t in self.tools or ()),
            tool_choice=tool_choice_of(self.tool_choice), parallel_tool_calls=self.parallel_tool_calls is not False,
            sampling=self.sampling(logprobs=bool(self.logprobs), top_logprobs=self.top_logprobs or 0),
            max_tokens=self.max_completion_tokens or self.max_tokens, answer_schema=answer,
            answer_schema_given=self.response_format is not None and self.response_format.type == "json_schema",
            retention_s=self.retention_s, model=self.model, legacy_functions=self.legacy_functions, fields=fields)


def tool_choice_of(choice: Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None,
                   ) -> generation.ToolChoice:
    """Chat's `tool_choice` (the one place that reads its three shapes)."""
    if isinstance(choice, AllowedToolsChoice):
        names = tuple(t.function.name for t in choice.allowed_tools.tools)
        return generation.ToolChoice(choice.allowed_tools.mode, allowed=names)
    if isinstance(choice, NamedToolChoice):
        return generation.ToolChoice("required", named=choice.function.name)
    return generation.ToolChoice(choice or "auto")


def _text_of(content: str | list[TextPart] | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def _args_text(arguments: str | dict[str, Any]) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
