"""The OpenAI Responses API request, and the generation request it amounts to.

A Responses request runs as the generation the equivalent chat request asks for (so its tool
group is cached exactly as chat's): `instructions` become the system message, input items become
messages (a `function_call` item joins the assistant turn before it, a `function_call_output` is
a tool message), flat function tools are the tools, `text.format` is the answer's schema, and
`include` `message.output_text.logprobs` (with `top_logprobs`) asks for logprobs. Errors the
service finds name Responses fields (`RESPONSES_FIELDS`). As in chat.py, fields toolkv does not
implement are a 400 naming the field unless they hold a value that asks for nothing; fields
outside OpenAI's API are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from adapters.base import FUNCTION_NAME_PATTERN, ChatMessage, ToolCallIn, ToolSpec
from gateway.protocol import generation
from gateway.protocol.fields import (
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
    PROMPT_CACHE_RETENTION_S,
    InvalidValue,
    Lenient,
    Metadata,
    ObjectSchema,
    UnsupportedField,
    UnsupportedValue,
    bracketed_type,
    implicit_caching,
    options_need_a_stream,
)
from gateway.protocol.generation import FieldNames, GenerationRequest, Sampling, ToolMode

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one `include` value there is something to add for


class TextPart(Lenient):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    id: str | None = None  # an item's own id (a past output item sent back) is kept for listing
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else "message"
    return {"function_call": "FunctionCall", "function_call_output": "FunctionCallOutput"}.get(kind, "Message")


# Tags start with a capital so error locations name the field, not the union member.
InputItem = Annotated[Annotated[MessageItem, Tag("Message")] | Annotated[FunctionCallItem, Tag("FunctionCall")]
                      | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")], Discriminator(_item_kind)]


class FunctionTool(Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: ObjectSchema | None = None
    strict: bool | None = None


class FunctionChoice(Lenient):
    type: Literal["function"]
    name: str


class AllowedFunction(Lenient):
    type: Literal["function"]
    name: str


class AllowedToolsChoice(Lenient):
    """Calls restricted to a subset of `tools` (all of which stay in the prompt and its cache)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[AllowedFunction] = Field(min_length=1)


def _choice_kind(value: Any) -> str:
    if isinstance(value, str):
        return "Mode"
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "AllowedTools" if kind == "allowed_tools" else "Function"


ToolChoice = Annotated[Annotated[Literal["none", "auto", "required"], Tag("Mode")]
                       | Annotated[FunctionChoice, Tag("Function")]
                       | Annotated[AllowedToolsChoice, Tag("AllowedTools")], Discriminator(_choice_kind)]


class PlainText(Lenient):
    type: Literal["text"]


class JsonObject(Lenient):
    type: Literal["json_object"]


class JsonSchema(Lenient):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64, pattern=FUNCTION_NAME_PATTERN)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[Annotated[PlainText, Tag("[text]")] | Annotated[JsonObject, Tag("[json_object]")]
                       | Annotated[JsonSchema, Tag("[json_schema]")],
                       Discriminator(bracketed_type, custom_error_type="format_type",
                                     custom_error_message="'type' must be 'text', 'json_object' or 'json_schema'")]


class TextConfig(Lenient):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # low / high: see UNSUPPORTED_ITEMS


class StreamOptions(Lenient):
    include_obfuscation: bool = True  # padding against length side channels: nothing to pad here


def _no_value(value: Any) -> bool:
    return value in ({}, []) or (isinstance(value, dict) and all(v is None for v in value.values()))


# Responses fields that are not implemented, each with the values that ask for nothing (accepted).
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "reasoning": _no_value,
    "background": lambda v: v is False,
    "conversation": lambda v: False,
    "prompt": lambda v: False,
    "truncation": lambda v: v == "disabled",
    "service_tier": lambda v: v in ("auto", "default"),
    "context_management": lambda v: v == [],
    "moderation": lambda v: False,
    "image": lambda v: False,
    "access_programs": lambda v: False,
    "background_options": lambda v: False,
    "prompt_cache_options": implicit_caching,
}
# Tool fields that would change how a function tool is offered or called.
UNSUPPORTED_TOOL_FIELDS: dict[str, Any] = {
    "defer_loading": lambda v: v is False,
    "allowed_callers": lambda v: v == ["direct"],
    "async": lambda v: v is False,
    "output_schema": lambda v: False,
}


class ResponsesRequest(Lenient):
    model: str | None = None
    input: list[InputItem] | str | None = None  # list first: its errors name the item
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_tool_calls: int | None = Field(None, ge=1)  # a bound on hosted-tool calls: there are none
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: Metadata | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None  # as chat's: carried into its request

    _options_need_a_stream = field_validator("stream_options")(options_need_a_stream)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_fields(data, UNSUPPORTED_FIELDS, "")
            _check_include(data.get("include"))
            _check_input(data.get("input"))
            _check_tools(data.get("tools"))
            _check_tool_choice(data.get("tool_choice"))
            text = data.get("text")
            if isinstance(text, dict) and text.get("verbosity") not in (None, "medium"):
                raise UnsupportedField("text.verbosity")
        return data

    @property
    def logprobs(self) -> bool:
        """Asked for the output text's logprobs (`top_logprobs` alone adds none, as OpenAI's)."""
        return LOGPROBS_INCLUDE in (self.include or ())

    @property
    def format(self) -> PlainText | JsonObject | JsonSchema:
        return self.text.format if self.text is not None and self.text.format is not None else PlainText(type="text")


def _check_fields(data: dict[str, Any], rules: dict[str, Any], prefix: str) -> None:
    for name, is_noop in rules.items():
        value = data.get(name)
        if value is not None and not is_noop(value):
            raise UnsupportedField(prefix + name)


def _check_include(include: Any) -> None:
    for index, value in enumerate(include if isinstance(include, list) else ()):
        if isinstance(value, str) and value != LOGPROBS_INCLUDE:
            raise UnsupportedValue(f"include[{index}]", f"include value '{value[:100]}' is not supported: this "
                                   f"server can include '{LOGPROBS_INCLUDE}' only")


def _check_input(items: Any) -> None:
    if not isinstance(items, list):
        return
    ids: set[str] = set()
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        item_id = item.get("id")
        if isinstance(item_id, str):  # another type is the model's to refuse
            if item_id in ids:  # as OpenAI: listing the items pages by id
                raise InvalidValue(f"input[{index}].id", f"input[{index}].id '{item_id[:64]}' repeats an "
                                   "earlier item's id: each input item's id must be unique")
            ids.add(item_id)
        kind = item.get("type", "message")
        if kind not in ("message", "function_call", "function_call_output"):
            raise UnsupportedValue(f"input[{index}].type", f"input items of type '{kind}' are not supported: "
                                   "send 'message', 'function_call' and 'function_call_output' items")
        content = item.get("content") if kind == "message" else item.get("output")
        field = "content" if kind == "message" else "output"
        for p_index, part in enumerate(content if isinstance(content, list) else ()):
            part_type = part.get("type") if isinstance(part, dict) else None
            if part_type not in ("input_text", "output_text", None):
                raise UnsupportedValue(f"input[{index}].{field}[{p_index}].type",
                                       f"content parts of type '{part_type}' are not supported: this server "
                                       "reads text ('input_text', 'output_text') only")


def _check_tools(tools: Any) -> None:
    for index, tool in enumerate(tools if isinstance(tools, list) else ()):
        if not isinstance(tool, dict):
            continue
        if tool.get("type") != "function":
            raise UnsupportedValue(f"tools[{index}].type", f"tools of type '{tool.get('type')}' are not "
                                   "supported: this server runs 'function' tools only")
        _check_fields(tool, UNSUPPORTED_TOOL_FIELDS, f"tools[{index}].")


def _check_tool_choice(choice: Any) -> None:
    if not isinstance(choice, dict):
        return
    if choice.get("type") not in ("function", "allowed_tools"):
        raise UnsupportedValue("tool_choice", f"tool_choice of type '{choice.get('type')}' is not supported: "
                               "send 'none', 'auto', 'required', {'type': 'function', 'name': ...} or "
                               "{'type': 'allowed_tools', 'mode': ..., 'tools': [...]}")
    allowed = choice.get("tools") if choice.get("type") == "allowed_tools" else None
    for index, tool in enumerate(allowed if isinstance(allowed, list) else ()):
        if isinstance(tool, dict) and tool.get("type") != "function":
            raise UnsupportedValue(f"tool_choice.tools[{index}].type", f"allowed tools of type '{tool.get('type')}' "
                                   "are not supported: this server runs 'function' tools only")


# ---- into a chat request ---------------------------------------------------------------------


def input_messages(request_input: list[InputItem] | str | None) -> list[dict[str, Any]]:
    """The chat messages that `input` adds to the conversation."""
    if request_input is None:
        return []
    if isinstance(request_input, str):
        return [{"role": "user", "content": request_input}]
    messages: list[dict[str, Any]] = []
    for item in request_input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text_of(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":  # calls join the turn they belong to
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text_of(item.output)})
    return messages


def to_generation(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> GenerationRequest:
    """The generation `req` asks for over `conversation` (stored turns + this input, as chat
    messages), as the equivalent chat request would; errors name Responses fields."""
    system = [ChatMessage("system", req.instructions)] if req.instructions is not None else []
    fmt = req.format
    schema = fmt.schema_ if isinstance(fmt, JsonSchema) else {"type": "object"} if isinstance(fmt, JsonObject) else None
    return GenerationRequest(
        messages=(*system, *(chat_message(message) for message in conversation)),
        tools=tuple(ToolSpec(t.name, t.description, t.parameters) for t in req.tools or ()),
        tool_choice=_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls is not False,
        sampling=Sampling(temperature=req.temperature, top_p=req.top_p, logprobs=req.logprobs,
                          top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0),
        max_tokens=req.max_output_tokens, answer_schema=schema, answer_schema_given=isinstance(fmt, JsonSchema),
        retention_s=PROMPT_CACHE_RETENTION_S if req.prompt_cache_retention == "24h" else 0.0, model=req.model,
        fields=RESPONSES_FIELDS)


def chat_message(message: dict[str, Any]) -> ChatMessage:
    """A conversation message (as `input_messages` and `assistant_turn` write them)."""
    calls = tuple(ToolCallIn(call["id"], call["function"]["name"], call["function"]["arguments"])
                  for call in message.get("tool_calls") or ())
    role = "system" if message["role"] == "developer" else message["role"]
    return ChatMessage(role, message.get("content"), calls, message.get("tool_call_id"))


def _tool_choice(choice: str | FunctionChoice | AllowedToolsChoice | None) -> generation.ToolChoice:
    if isinstance(choice, FunctionChoice):
        return generation.ToolChoice("required", named=choice.name)
    if isinstance(choice, AllowedToolsChoice):
        return generation.ToolChoice(choice.mode, allowed=tuple(tool.name for tool in choice.tools))
    return generation.ToolChoice("auto" if choice is None else cast(ToolMode, choice))


def _text_of(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


# Where the service's checks find a Responses request's fields (the conversation is `input`).
RESPONSES_FIELDS = FieldNames(messages="input", tool_name="tools[{}].name", tool_parameters="tools[{}].parameters",
                              allowed_tool="tool_choice.tools[{}].name", max_tokens="max_output_tokens",
                              response_format="text.format", answer_schema="text.format", call_arguments="input")
