"""The OpenAI Responses API request, and its translation into a chat request.

A Responses request runs as the chat request it amounts to (so its tool group is cached exactly
as chat's): `instructions` become the system message, input items become messages (a
`function_call` item joins the assistant turn before it, a `function_call_output` is a tool
message), flat function tools become chat tools, `text.format` becomes `response_format`, and `include`
`message.output_text.logprobs` (with `top_logprobs`) becomes chat's `logprobs` (`top_logprobs`).
As in protocol.py, fields toolkv does not implement are a 400 naming the field unless they hold
a value that asks for nothing; fields outside OpenAI's API are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from adapters.base import FUNCTION_NAME_PATTERN
from gateway.protocol.fields import (
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
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


def chat_body(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request `req` amounts to, over `conversation` (stored turns + this input)."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    body: dict[str, Any] = {"messages": system + conversation, "stream": req.stream}
    if req.model is not None:
        body["model"] = req.model
    if req.tools:
        body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    fields = {"parallel_tool_calls": req.parallel_tool_calls, "max_completion_tokens": req.max_output_tokens,
              "temperature": req.temperature, "top_p": req.top_p, "prompt_cache_retention": req.prompt_cache_retention}
    body.update({name: value for name, value in fields.items() if value is not None})
    if req.logprobs:
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    response_format = _response_format(req.format)
    if response_format is not None:
        body["response_format"] = response_format
    return body


def _chat_tool_choice(choice: str | FunctionChoice | AllowedToolsChoice) -> str | dict[str, Any]:
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, AllowedToolsChoice):
        tools = [{"type": "function", "function": {"name": tool.name}} for tool in choice.tools]
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.mode, "tools": tools}}
    return choice


def _response_format(fmt: PlainText | JsonObject | JsonSchema) -> dict[str, Any] | None:
    if isinstance(fmt, JsonSchema):
        spec = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
        return {"type": "json_schema", "json_schema": spec}
    return {"type": "json_object"} if isinstance(fmt, JsonObject) else None


def _text_of(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


CHAT_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens"}


def responses_param(chat_param: str | None) -> str | None:
    """The Responses field a chat-side error names: `messages[2].content` is in `input`,
    `tools[0].function.name` is `tools[0].name`, `response_format` is `text.format`."""
    if chat_param is None:
        return None
    if chat_param.startswith("messages"):
        return "input"
    if chat_param.startswith("response_format"):
        return "text.format"
    if chat_param.startswith("tools["):
        return chat_param.replace(".function", "", 1)
    if chat_param.startswith("tool_choice.allowed_tools."):  # .tools[i].function.name is .tools[i].name
        return "tool_choice." + chat_param.removeprefix("tool_choice.allowed_tools.").replace(".function", "", 1)
    return CHAT_PARAMS.get(chat_param, chat_param)
