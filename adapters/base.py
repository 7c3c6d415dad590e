"""Plain data shared by the adapters, and the `ChatFamily` contract each family fulfils."""

from __future__ import annotations

import hashlib
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import orjson

# OpenAI's rule for function names (it answers 400 for anything else). Names are written into the
# prompt as JSON strings: a name JSON escapes (`"`, `\`, control characters) would read differently
# there than in the request, so the rule also keeps every name verbatim in the rendered tool group.
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
_FUNCTION_NAME = re.compile(FUNCTION_NAME_PATTERN)


def check_function_name(name: str) -> str:
    """`name` when OpenAI would accept it as a function name; else a ValueError saying the rule
    (for a pydantic `AfterValidator`, which reports it under the field's path)."""
    if not _FUNCTION_NAME.fullmatch(name):
        raise ValueError("a function name is 1-64 characters from a-z, A-Z, 0-9, '_' and '-'")
    return name


# The keys of a parameters schema that can say "no arguments"; any other key may constrain `{}`.
_EMPTY_OBJECT_KEYS = frozenset({"type", "properties", "required", "additionalProperties", "title",
                                "description", "$schema", "$comment"})


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @property
    def takes_no_arguments(self) -> bool:
        """True when `{}` is the only sensible arguments object, and valid: an object schema with
        no properties, none required and none open-ended, and nothing else that constrains it.

        An absent `additionalProperties` counts as closed: `{"type": "object", "properties": {}}`
        is how OpenAI clients declare a function without parameters. Anything else (`$ref`,
        `allOf`, `required` keys without `properties`, ...) is left to the grammar, which knows
        whether `{}` is valid."""
        params = self.parameters or {}
        if not set(params) <= _EMPTY_OBJECT_KEYS:
            return False
        open_ended = params.get("additionalProperties") not in (None, False)
        return (params.get("type", "object") == "object" and not params.get("properties")
                and not params.get("required") and not open_ended)

    def openai_dict(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolCallIn:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # system | user | assistant | tool ("developer" arrives here as "system")
    content: str | None
    tool_calls: tuple[ToolCallIn, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None


def canonical_rank(tool: ToolSpec) -> tuple[int, str]:
    """Where a tool goes in its group: largest schema first, then by name. A function of the tool
    alone, so the same set in any order is the same group and adding or removing a tool never
    moves the others. Of the orders measured on the merchant, retail and airline catalogs (name,
    hash, size either way), largest first keeps the longest common prefix when one tool is added
    or removed: 52-69% of the old group's tokens averaged over every position (name order: 46-53%),
    and 95-98% when the change is at the end (the smallest tool). The KV before the first
    differing token is reused (docs/design.md, agent loops)."""
    size = len(json.dumps(tool.openai_dict(), sort_keys=True, ensure_ascii=False))
    return -size, tool.name


@dataclass(frozen=True, slots=True)
class ToolGroup:
    """The cacheable head of every prompt: the leading system text and the tools, canonically ordered."""

    system: str | None
    tools: tuple[ToolSpec, ...] = field(default=())

    @classmethod
    def of(cls, system: str | None, tools: list[ToolSpec] | tuple[ToolSpec, ...]) -> ToolGroup:
        return cls(system=system, tools=tuple(sorted(tools, key=canonical_rank)))

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tools)

    @property
    def group_id(self) -> str:
        """Human-facing id for logs, metrics and listings (not the cache key)."""
        blob = json.dumps([self.system, [t.openai_dict() for t in self.tools]], ensure_ascii=False)
        return "tg_" + hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    text: str
    prefix_chars: int  # text[:prefix_chars] is the tool group; 0 when it cannot be cut safely
    group: ToolGroup


@dataclass(frozen=True, slots=True)
class CallSyntax:
    """How a family writes its calls, piece by piece, for the grammar that constrains them and the
    streamer that reads them as they are generated:

        section_open call (separator call)* section_close
        call = call_open <name as a JSON string> name_to_args <arguments: a JSON object> call_close

    `trigger` is the text that starts a call section in free text (`tool_choice: "auto"`); the
    section starts with it. `leading_only`: calls are the whole output or absent (Llama 3)."""

    trigger: str
    section_open: str
    call_open: str
    name_to_args: str
    call_close: str
    separator: str
    section_close: str = ""
    leading_only: bool = False

    @property
    def head(self) -> str:
        """The text before the first call's name: it starts with the trigger."""
        return self.section_open + self.call_open


def arguments_object(arguments: str) -> Any:
    """OpenAI sends arguments as JSON text; prompts want the object, or the text itself where it is
    not strict JSON. Python's parser also takes NaN, infinities and lone surrogate escapes, none of
    which the prompt could hold as the client wrote them (a lone surrogate cannot even be
    tokenized); strict JSON is what orjson takes, as the request's depth check does
    (gateway/edge/limits.py), so text that check passed over as not JSON stays text here. The value
    itself comes from Python's parser, which keeps integers past 64 bits exact."""
    try:
        orjson.loads(arguments)
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments


class ChatFamily(ABC):
    """What differs between model families: how tools and tool turns are written, how calls look."""

    name: str
    tool_parser: str

    @abstractmethod
    def tools_block(self, tools: tuple[ToolSpec, ...]) -> str:
        """Text appended to the system message when the model's own template drops tools."""

    @abstractmethod
    def assistant_text(self, message: ChatMessage) -> str:
        """An assistant turn with tool calls, written as the model would have written it."""

    @abstractmethod
    def tool_result_text(self, message: ChatMessage) -> str:
        """A tool result, written as the model expects to read it (as a user turn)."""

    @abstractmethod
    def call_opening(self, function_name: str | None) -> str:
        """The text that opens a call (of `function_name`, if given), to force one. Named, it is
        a prefix of `assistant_text` for a call of that function."""

    @abstractmethod
    def call_syntax(self) -> CallSyntax:
        """The pieces `assistant_text` writes a call section with (see CallSyntax)."""

    def call_text(self, function_name: str, arguments: str = "{}") -> str:
        """One whole call, as the model writes it (`arguments` is JSON text)."""
        call = ToolCallIn(id="", name=function_name, arguments=arguments)
        return self.assistant_text(ChatMessage(role="assistant", content=None, tool_calls=(call,)))

    default_template: str | None = None  # used when the tokenizer has no chat template
    # The family's own template, rendering `tools` itself with the tool group at the head; used
    # when the model's template does not keep the tool group at the head (Mistral's puts tools
    # before the last user message, so no prefix could be shared between turns).
    tools_template: str | None = None
    call_markers: tuple[str, ...] = ()  # special tokens that open a call; kept in the output text
    tool_result_role: str = "user"  # the role tool results are written under when the template has none
