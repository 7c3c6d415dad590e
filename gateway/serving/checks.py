"""The checks a chat request passes before any grammar is built or token generated: unique tool
names, schemas with a finite instance, a `tool_choice` that names listed tools; and what the
tokenizer tells about the request's limits (the longest token, the call markers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapters.base import ToolSpec
from gateway.engine import Tokenizer
from gateway.errors import BadRequest
from gateway.protocol import chat as protocol
from gateway.protocol.chat import AllowedToolsChoice, ChatCompletionRequest, NamedToolChoice
from gateway.serving.finite_schemas import has_finite_instance


def check_unique_names(tools: list[Any]) -> None:
    """400 naming the first tool whose function name repeats an earlier one."""
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        if tool.name in seen:
            raise BadRequest(f"tools[{index}].function.name '{tool.name}' appears twice",
                             param=f"tools[{index}].function.name")
        seen.add(tool.name)


def check_finite_schemas(tools: list[ToolSpec], response_format: protocol.ResponseFormat | None,
                         finite: Callable[[Any], bool] = has_finite_instance) -> None:
    """400 naming the first schema no finite value is valid for (gateway/serving/finite_schemas.py): its
    grammar would compile, then fail in the middle of the answer. `finite` is the check (or a memo of it)."""
    named = [(f"tools[{index}].function.parameters", tool.parameters) for index, tool in enumerate(tools)]
    answer = response_format.answer_schema if response_format is not None else None
    for param, schema in [*named, ("response_format.json_schema.schema", answer)]:
        if schema is not None and not finite(schema):
            raise BadRequest(f"{param} has no finite value: no JSON value is valid for it (an unknown type, "
                             "an empty anyOf, `false`), or every one it allows holds another (a $ref that loops "
                             "back with no way out: make the recursion optional, not required, minItems 0, or "
                             "anyOf with null)", param=param)


def check_tool_choice(req: ChatCompletionRequest) -> None:
    choice, listed = req.tool_choice, {t.function.name for t in req.tools or ()}
    if choice == "required" and not listed:
        raise BadRequest("tool_choice 'required' needs 'tools'", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in listed:
        raise BadRequest(f"tool_choice names the function '{choice.function.name}', which is not in 'tools'",
                         param="tool_choice")
    for index, allowed in enumerate(choice.allowed_tools.tools if isinstance(choice, AllowedToolsChoice) else ()):
        if allowed.function.name not in listed:
            param = f"tool_choice.allowed_tools.tools[{index}].function.name"
            raise BadRequest(f"{param} names the function '{allowed.function.name}', which is not in 'tools' "
                             "(allowed tools are a subset of 'tools')", param=param)


def forced_name(req: ChatCompletionRequest, tools: list[ToolSpec]) -> str | None:
    """The one tool a call must name: a named function, or `required` with one callable tool."""
    names = [t.name for t in tools if req.may_call(t.name)]
    return names[0] if req.tool_mode == "required" and len(names) == 1 else None


def max_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters one token can stand for. A vocabulary entry's string has one character
    per byte (byte-level BPE) or per character (SentencePiece's `▁` for a space), and a character
    is at least one byte, so no token covers more characters than its entry is long. (This holds
    for tokenizers whose normalizer never deletes characters: every chat model's here.)"""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def marker_ids(tokenizer: Tokenizer, markers: tuple[str, ...]) -> frozenset[int]:
    """Ids of the family's call markers that are single tokens in this vocabulary."""
    vocab = tokenizer.get_vocab()
    return frozenset(vocab[m] for m in markers if m in vocab)




def special_markers(tokenizer: Tokenizer, markers: tuple[str, ...], special: frozenset[int]) -> dict[str, int]:
    """The family's call markers that are special tokens here: a grammar names them by id."""
    vocab = tokenizer.get_vocab()
    return {m: vocab[m] for m in markers if m in vocab and vocab[m] in special}
