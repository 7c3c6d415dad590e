"""The checks a generation request passes before any grammar is built or token generated: unique tool
names, schemas with a finite instance, a `tool_choice` that names listed tools; and what the
tokenizer tells about the request's limits (the longest token, the call markers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapters.base import ToolSpec
from gateway.engine import Tokenizer
from gateway.errors import BadRequest
from gateway.protocol.generation import CHAT_FIELDS, FieldNames, GenerationRequest
from gateway.serving.finite_schemas import has_finite_instance


def check_unique_names(tools: list[Any], names: FieldNames = CHAT_FIELDS) -> None:
    """400 naming the first tool whose function name repeats an earlier one."""
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        if tool.name in seen:
            param = names.tool_name.format(index)
            raise BadRequest(f"{param} '{tool.name}' appears twice", param=param)
        seen.add(tool.name)


def check_finite_schemas(req: GenerationRequest, tools: list[ToolSpec],
                         finite: Callable[[Any], bool] = has_finite_instance) -> None:
    """400 naming the first schema no finite value is valid for (gateway/serving/finite_schemas.py): its
    grammar would compile, then fail in the middle of the answer. `finite` is the check (or a memo of it)."""
    names = req.fields
    named = [(names.tool_parameters.format(index), tool.parameters) for index, tool in enumerate(tools)]
    for param, schema in [*named, (names.answer_schema, req.answer_schema)]:
        if schema is not None and not finite(schema):
            raise BadRequest(f"{param} has no finite value: no JSON value is valid for it (an unknown type, "
                             "an empty anyOf, `false`), or every one it allows holds another (a $ref that loops "
                             "back with no way out: make the recursion optional, not required, minItems 0, or "
                             "anyOf with null)", param=param)


def check_tool_choice(req: GenerationRequest) -> None:
    choice, listed, names = req.tool_choice, {t.name for t in req.tools}, req.fields
    if choice.mode == "required" and choice.named is None and choice.allowed is None and not listed:
        raise BadRequest(f"{names.tool_choice} 'required' needs '{names.tools}'", param=names.tool_choice)
    if choice.named is not None and choice.named not in listed:
        raise BadRequest(f"{names.tool_choice} names the function '{choice.named}', which is not in "
                         f"'{names.tools}'", param=names.tool_choice)
    for index, allowed in enumerate(choice.allowed or ()):
        if allowed not in listed:
            param = names.allowed_tool.format(index)
            raise BadRequest(f"{param} names the function '{allowed}', which is not in '{names.tools}' "
                             f"(allowed tools are a subset of '{names.tools}')", param=param)


def forced_name(req: GenerationRequest, tools: list[ToolSpec]) -> str | None:
    """The one tool a call must name: a named function, or `required` with one callable tool."""
    names = [t.name for t in tools if req.tool_choice.may_call(t.name)]
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
