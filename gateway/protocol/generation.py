"""A generation request as the service (gateway/serving/service.py) takes it, whichever API it came
by: the conversation, the tools and how they may be called, the sampling, the answer's format,
the limits, and the client's own names for the fields (`FieldNames`). Each protocol module
(chat.py, messages.py, responses.py) turns its validated request into one, so every error the
service raises names the field as that client wrote it; no error is renamed afterwards. Here,
among the protocol's leaves, because those modules build it and serving reads it (a protocol
module importing serving would close a cycle: tests/test_import_rules.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from adapters.base import ChatMessage, ToolSpec

ToolMode = Literal["none", "auto", "required"]


@dataclass(frozen=True, slots=True)
class FieldNames:
    """Where a request's fields are in the client's request (chat's names by default): each API
    says where its tools, tool choice, limits and answer schema are."""

    messages: str = "messages"  # the conversation, and the prompt it renders to
    tools: str = "tools"
    tool: str = "tools[{}]"  # a tool, by index ({}); its name and parameters below
    tool_name: str = "tools[{}].function.name"
    tool_parameters: str = "tools[{}].function.parameters"
    tool_word: str = "tool"  # what the API calls a tool in prose (legacy chat: "function")
    tool_choice: str = "tool_choice"
    allowed_tool: str = "tool_choice.allowed_tools.tools[{}].function.name"
    max_tokens: str = "max_tokens"
    stop: str = "stop"
    response_format: str = "response_format"
    answer_schema: str = "response_format.json_schema.schema"
    call_arguments: str = "messages[{}].tool_calls[{}].function.arguments"  # by message and call index


CHAT_FIELDS = FieldNames()
# chat's deprecated `functions` and `function_call`, served as tools
FUNCTIONS_FIELDS = FieldNames(tools="functions", tool="functions[{}]", tool_name="functions[{}].name",
                              tool_parameters="functions[{}].parameters", tool_word="function",
                              tool_choice="function_call")


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """How the answer may call the tools: `mode`, narrowed to one `named` function or to the
    `allowed` subset (in the client's order: an error names the first that is not a tool)."""

    mode: ToolMode = "auto"
    named: str | None = None
    allowed: tuple[str, ...] | None = None

    def may_call(self, name: str) -> bool:
        """`name` is a tool the answer may call (every listed tool unless narrowed)."""
        if self.named is not None:
            return name == self.named
        return self.allowed is None or name in self.allowed


@dataclass(frozen=True, slots=True)
class Sampling:
    """How tokens are chosen (None: the default)."""

    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (decimal text) -> bias
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation, validated as far as its own API's model can validate it; the service
    checks the rest (against the model, the tokenizer, the context) naming `fields`."""

    messages: tuple[ChatMessage, ...]
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    sampling: Sampling = field(default_factory=Sampling)
    max_tokens: int | None = None  # None: the server's default, cut to the room the context leaves
    answer_schema: dict[str, Any] | None = None  # the answer must be JSON valid for it
    answer_schema_given: bool = False  # the client wrote the schema (json_object's is implied)
    retention_s: float = 0.0  # keep the tool group cached at least this long
    model: str | None = None
    legacy_functions: bool = False  # asked with `functions`: the answer carries `function_call`
    fields: FieldNames = CHAT_FIELDS

    @property
    def tool_mode(self) -> ToolMode:
        return "required" if self.tool_choice.named is not None else self.tool_choice.mode
