"""Anthropic's Messages API on the wire: the request, the generation request it amounts to, and
Anthropic's error envelope (the answer is built in gateway/api/messages_stream.py).

A Messages request runs as the generation the equivalent chat request asks for (so its tool
group and earlier turns are cached exactly as chat's, and the two share KV): `system` becomes the
system message, a `tool_use` block joins its assistant turn as a tool call, a `tool_result` block
is a tool message, tools' `input_schema` is their parameters, `tool_choice` `any` is `required`
and `disable_parallel_tool_use` allows one call, `output_config.format` is the answer's schema.
Errors the service finds name Messages fields (`MESSAGES_FIELDS`). `cache_control` breakpoints
(and the top-level one) are accepted wherever Anthropic allows them and need nothing more: the
tool group and earlier turns are cached without them. As in chat.py, fields toolkv does not
implement are a 400 naming the field unless they hold a value that asks for nothing (`top_k`,
extended thinking, server tools, images); fields outside Anthropic's API are ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from adapters.base import FUNCTION_NAME_PATTERN, ChatMessage, ToolCallIn, ToolSpec
from gateway.errors import BadRequest
from gateway.protocol import generation
from gateway.protocol.fields import (
    MAX_TOKENS_LIMIT,
    Lenient,
    ObjectSchema,
    UnsupportedField,
    UnsupportedValue,
    bracketed_type,
)
from gateway.protocol.generation import FieldNames, GenerationRequest, Sampling
from gateway.protocol.messages_rules import check_rules


class CacheControl(Lenient):
    """A prompt-caching breakpoint: honoured implicitly (the tool group and earlier turns are cached
    whether marked or not, and kept by toolkv's own eviction, whatever the `ttl`)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Lenient):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: list[TextBlock] | str | None = None  # list first in errors: they name the block
    is_error: bool | None = None  # the model reads the result's text; chat has no error flag to carry
    cache_control: CacheControl | None = None


BLOCK_TAGS = {"text": "Text", "tool_use": "ToolUse", "tool_result": "ToolResult"}


def _block_kind(value: Any) -> str:
    """The tag of a block, a dict when validating or a model when serializing."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return BLOCK_TAGS.get(kind, "Text") if isinstance(kind, str) else "Text"


# Tags start with a capital so error locations name the field, not the union member.
ContentBlock = Annotated[Annotated[TextBlock, Tag("Text")] | Annotated[ToolUseBlock, Tag("ToolUse")]
                         | Annotated[ToolResultBlock, Tag("ToolResult")], Discriminator(_block_kind)]


class MessageIn(Lenient):
    role: Literal["user", "assistant", "system"]
    content: Annotated[list[ContentBlock], Field(min_length=1)] | str  # list first: errors name the block


class ToolIn(Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=FUNCTION_NAME_PATTERN)  # as chat's tools
    description: str | None = None
    input_schema: ObjectSchema
    type: Literal["custom"] | None = None
    strict: bool | None = None  # the grammar holds every call to its schema, strict or not
    cache_control: CacheControl | None = None


class AutoChoice(Lenient):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class AnyChoice(Lenient):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNamed(Lenient):
    type: Literal["tool"]
    name: str = Field(min_length=1)
    disable_parallel_tool_use: bool | None = None


class NoneChoice(Lenient):
    type: Literal["none"]


ToolChoice = Annotated[Annotated[AutoChoice, Tag("[auto]")] | Annotated[AnyChoice, Tag("[any]")]
                       | Annotated[ToolChoiceNamed, Tag("[tool]")] | Annotated[NoneChoice, Tag("[none]")],
                       Discriminator(bracketed_type, custom_error_type="tool_choice_type",
                                     custom_error_message="'type' must be 'auto', 'any', 'tool' or 'none'")]


class ThreadCreate(Lenient):
    type: Literal["create"]


class ThreadContinue(Lenient):
    type: Literal["continue"]
    previous_message_id: str = Field(min_length=1, max_length=200)


Thread = Annotated[Annotated[ThreadCreate, Tag("[create]")] | Annotated[ThreadContinue, Tag("[continue]")],
                   Discriminator(bracketed_type, custom_error_type="thread_type",
                                 custom_error_message="'type' must be 'create' or 'continue'")]


class Metadata(Lenient):
    user_id: str | None = None


class JsonOutputFormat(Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Lenient):
    format: JsonOutputFormat | None = None
    effort: Literal["high"] | None = None  # Anthropic's default; other levels: see UNSUPPORTED_FIELDS


# Messages fields that are not implemented, each with the values that ask for nothing (accepted).
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "top_k": lambda v: False,  # the sampler has no top-k: temperature and top_p only
    "thinking": lambda v: isinstance(v, dict) and v.get("type") == "disabled",
    "service_tier": lambda v: v in ("auto", "standard_only"),
    "container": lambda v: False,
    "mcp_servers": lambda v: v == [],
    "context_management": lambda v: False,
    "output_format": lambda v: False,
    "diagnostics": lambda v: False,  # no cache-miss reasons to give
    "inference_geo": lambda v: False,
    "speed": lambda v: v == "standard",
}
# Tool fields that would change how a tool is offered or called.
UNSUPPORTED_TOOL_FIELDS: dict[str, Any] = {
    "defer_loading": lambda v: v is False,
    "allowed_callers": lambda v: v == ["direct"],
    "input_examples": lambda v: v == [],
}
TOOL_CHOICE_TYPES = ("auto", "any", "tool", "none")
MAX_STOP_SEQUENCES = 4


class MessagesRequest(Lenient):
    model: str | None = None
    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    messages: list[MessageIn] = Field(min_length=1)
    system: list[TextBlock] | str | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # automatic caching: what toolkv does anyway
    thread: Thread | None = None  # gateway/api/threads.py

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_fields(data, UNSUPPORTED_FIELDS, "")
            _check_messages(data.get("messages"))
            _check_tools(data.get("tools"))
            choice = data.get("tool_choice")
            if isinstance(choice, dict) and choice.get("type") not in TOOL_CHOICE_TYPES:
                raise UnsupportedValue("tool_choice.type", f"tool_choice of type '{str(choice.get('type'))[:40]}' "
                                       "is not supported: send 'auto', 'any', 'tool' or 'none'")
            config = data.get("output_config")
            if isinstance(config, dict) and config.get("effort") not in (None, "high"):
                raise UnsupportedField("output_config.effort")
        return data

    @field_validator("stop_sequences")
    @classmethod
    def _at_most_four(cls, stops: list[str] | None) -> list[str] | None:
        if stops is not None and len(stops) > MAX_STOP_SEQUENCES:  # as chat's `stop`: the sampler's limit
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        return stops

    @model_validator(mode="after")
    def _anthropics_rules(self) -> MessagesRequest:
        check_rules(self)  # breakpoints, blank text, stop sequences: gateway/protocol/messages_rules.py
        return self


class CountTokensRequest(MessagesRequest):
    """`POST /v1/messages/count_tokens`: a message's fields without `max_tokens` (ignored when sent:
    one token of room, so a prompt that fills the context is refused as a message would be)."""

    @model_validator(mode="before")
    @classmethod
    def _one_token_of_room(cls, data: Any) -> Any:
        return {**data, "max_tokens": 1} if isinstance(data, dict) else data


def _check_fields(data: dict[str, Any], rules: dict[str, Any], prefix: str) -> None:
    for name, is_noop in rules.items():
        value = data.get(name)
        if value is not None and not is_noop(value):
            raise UnsupportedField(prefix + name)


def _check_messages(messages: Any) -> None:
    """Blocks of a type toolkv does not read (images, documents, thinking, server tools' blocks)."""
    for index, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for b_index, block in enumerate(content if isinstance(content, list) else ()):
            _check_block(block, f"messages[{index}].content[{b_index}]", tuple(BLOCK_TAGS))
            inner = block.get("content") if isinstance(block, dict) and block.get("type") == "tool_result" else None
            for i_index, part in enumerate(inner if isinstance(inner, list) else ()):
                _check_block(part, f"messages[{index}].content[{b_index}].content[{i_index}]", ("text",))


def _check_block(block: Any, path: str, known: tuple[str, ...]) -> None:
    kind = block.get("type") if isinstance(block, dict) else None
    if isinstance(kind, str) and kind not in known:
        raise UnsupportedValue(f"{path}.type", f"content blocks of type '{kind[:40]}' are not supported here: this "
                               f"server reads {', '.join(repr(k) for k in known)} blocks")


def _check_tools(tools: Any) -> None:
    for index, tool in enumerate(tools if isinstance(tools, list) else ()):
        if not isinstance(tool, dict):
            continue
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise UnsupportedValue(f"tools[{index}].type", f"tools of type '{str(kind)[:60]}' are not supported: "
                                   "this server runs client tools (with an 'input_schema') only")
        _check_fields(tool, UNSUPPORTED_TOOL_FIELDS, f"tools[{index}].")


# ---- into a generation request --------------------------------------------------------------


def to_generation(req: MessagesRequest) -> GenerationRequest:
    """The generation `req` asks for, as the chat request it amounts to would (the same prompt,
    so the two share their KV); errors name Messages fields (`MESSAGES_FIELDS`)."""
    last = req.messages[-1]
    if last.role == "assistant":
        raise BadRequest("a final assistant message (prefilling the answer) is not supported: end with a "
                         "user message", param=f"messages[{len(req.messages) - 1}]")
    messages = [_system(req.system)] if req.system is not None else []
    for index, message in enumerate(req.messages):
        messages += _chat_messages(message, f"messages[{index}]")
    choice = req.tool_choice
    schema = req.output_config.format.schema_ if req.output_config and req.output_config.format else None
    return GenerationRequest(
        messages=tuple(messages), tools=tuple(_tool_spec(tool) for tool in req.tools or ()),
        tool_choice=_tool_choice(choice), parallel_tool_calls=not getattr(choice, "disable_parallel_tool_use", None),
        sampling=Sampling(temperature=req.temperature, top_p=req.top_p,
                          stop=tuple(stop for stop in req.stop_sequences or () if stop)),
        max_tokens=req.max_tokens, answer_schema=schema, answer_schema_given=schema is not None, model=req.model,
        fields=MESSAGES_FIELDS)


def _system(system: str | list[TextBlock]) -> ChatMessage:
    return ChatMessage("system", _text(system))


def _chat_messages(message: MessageIn, where: str) -> list[ChatMessage]:
    """One Anthropic message as chat messages: a user turn's tool results are tool messages (in
    order, around its text), an assistant turn's tool_use blocks its tool calls."""
    content = message.content
    if isinstance(content, str):
        return [ChatMessage(message.role, content)]
    texts = [block for block in content if isinstance(block, TextBlock)]
    if message.role == "system":
        if len(texts) < len(content):
            raise BadRequest("a system message holds text blocks only", param=where)
        return [_system(texts)]
    if message.role == "assistant":
        if any(isinstance(block, ToolResultBlock) for block in content):
            raise BadRequest("an assistant message cannot hold a 'tool_result' block (tool results are sent in "
                             "the user message that follows)", param=where)
        calls = tuple(ToolCallIn(block.id, block.name, json.dumps(block.input, ensure_ascii=False))
                      for block in content if isinstance(block, ToolUseBlock))
        return [ChatMessage("assistant", _text(texts) if texts or not calls else None, calls)]
    out: list[ChatMessage] = []
    texts = []  # the user's text since the last tool result
    for block in content:
        if isinstance(block, ToolResultBlock):
            if texts:
                out.append(ChatMessage("user", _text(texts)))
                texts = []
            out.append(ChatMessage("tool", _text(block.content or ""), tool_call_id=block.tool_use_id))
        elif isinstance(block, TextBlock):
            texts.append(block)
        else:
            raise BadRequest("a user message cannot hold a 'tool_use' block (the assistant's calls are in its "
                             "own turn)", param=where)
    if texts:
        out.append(ChatMessage("user", _text(texts)))
    return out


def _text(content: str | list[TextBlock]) -> str:
    """Text blocks' text, joined as chat joins its text parts."""
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _tool_spec(tool: ToolIn) -> ToolSpec:
    return ToolSpec(name=tool.name, description=tool.description, parameters=tool.input_schema)


def _tool_choice(choice: AutoChoice | AnyChoice | ToolChoiceNamed | NoneChoice | None) -> generation.ToolChoice:
    if isinstance(choice, ToolChoiceNamed):
        return generation.ToolChoice("required", named=choice.name)
    if isinstance(choice, AnyChoice):
        return generation.ToolChoice("required")
    return generation.ToolChoice(choice.type if choice is not None else "auto")


# Where the service's checks find a Messages request's fields (a turn with tool results is several
# chat messages: errors about one name `messages`).
MESSAGES_FIELDS = FieldNames(tool_name="tools[{}].name", tool_parameters="tools[{}].input_schema",
                             stop="stop_sequences", response_format="output_config.format",
                             answer_schema="output_config.format.schema", call_arguments="messages")


# ---- errors --------------------------------------------------------------------------------

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


THREAD_NOT_FOUND = "thread_not_found"
DETAILED_CODES = frozenset({THREAD_NOT_FOUND})  # Anthropic's `error_code`s toolkv gives, which the SDKs act on


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """Anthropic's error envelope; its `type` follows the status, as Anthropic's do. It has no
    `param`: a message that does not name the field it is about starts with it (`tools[0].type: `).
    An error the SDKs act on (a thread not found: they replay the conversation) names its
    `details.error_code`."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    if param and param not in message:
        message = f"{param}: {message}"
    error: dict[str, Any] = {"type": kind, "message": message}
    if code in DETAILED_CODES:
        error["details"] = {"error_code": code}
    return {"type": "error", "error": error}
