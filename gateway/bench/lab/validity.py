"""What the constrained scenario checks in an answer, as a client would see it: the message of a
whole response, or the message an OpenAI SDK assembles from a stream's deltas (openai-python's
`accumulate_delta`: strings concatenate, except `index` and `type`; list entries merge by
`index`). Each check returns the first problem, or None when the answer is valid.

A tool answer is valid when it has at least one call, every call is to a listed tool (the named
one, when one was named) with arguments that parse as a JSON object valid for that tool's schema,
no call markup reaches `content`, and it ended by itself (`max_tokens` cutting it, `length`, is a
failure). A structured answer is valid when its content parses and validates against the schema
(any JSON object for `json_object`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator, exceptions, validators  # type: ignore[import-untyped]

# The call syntax of the families toolkv serves (Hermes/ChatML, Llama 3, Mistral) and their turn
# markers: none may reach `content`.
MARKUP = ("<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "<|im_start|>", "<|im_end|>",
          "<|eot_id|>", "<|start_header_id|>")
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class Answer:
    content: str | None
    calls: tuple[dict[str, Any], ...]  # {"id", "type", "function": {"name", "arguments"}}
    finish_reason: str | None

    @classmethod
    def of_response(cls, response: dict[str, Any]) -> Answer:
        choice = response["choices"][0]
        message = choice.get("message") or {}
        return cls(message.get("content"), tuple(message.get("tool_calls") or ()), choice.get("finish_reason"))

    @property
    def first_tool(self) -> str | None:
        return str(self.calls[0].get("function", {}).get("name")) if self.calls else None


class StreamAssembler:
    """Builds the message from chat.completion.chunk objects, as openai-python does."""

    def __init__(self) -> None:
        self.message: dict[str, Any] = {}
        self.finish_reason: str | None = None

    def feed(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            accumulate(self.message, choice.get("delta") or {})
            self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def answer(self) -> Answer:
        return Answer(self.message.get("content"), tuple(self.message.get("tool_calls") or ()), self.finish_reason)


def accumulate(acc: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """openai-python's `accumulate_delta`, for the shapes a chat chunk has."""
    for key, value in delta.items():
        old = acc.get(key)
        if old is None:
            acc[key] = [] if _indexed(value) else copy.deepcopy(value)
            if not _indexed(value):
                continue
            old = acc[key]
        if key in ("index", "type"):
            acc[key] = value
        elif isinstance(old, str) and isinstance(value, str):
            acc[key] = old + value
        elif isinstance(old, dict) and isinstance(value, dict):
            accumulate(old, value)
        elif isinstance(old, list) and isinstance(value, list):
            _merge_entries(old, value)
        else:
            acc[key] = value
    return acc


def _indexed(value: Any) -> bool:
    return isinstance(value, list) and any(isinstance(v, dict) and "index" in v for v in value)


def _merge_entries(acc: list[Any], entries: list[Any]) -> None:
    for entry in entries:
        index = entry["index"]
        if index < len(acc):
            accumulate(acc[index], entry)
        else:
            acc.insert(index, copy.deepcopy(entry))


def call_problem(answer: Answer, tools: dict[str, dict[str, Any]], named: str | None) -> str | None:
    """Why `answer` is not a valid forced call to one of `tools` (name -> tool), or None."""
    ended = _ending_problem(answer, ("tool_calls", "stop"))
    if ended or not answer.calls:
        return ended or f"no tool call (content: {(answer.content or '')[:80]!r})"
    if leaked := _markup(answer.content):
        return f"call markup {leaked!r} in content"
    for number, call in enumerate(answer.calls):
        if problem := _one_call_problem(call, tools, named):
            return f"call {number}: {problem}"
    return None


def _one_call_problem(call: dict[str, Any], tools: dict[str, dict[str, Any]], named: str | None) -> str | None:
    function = call.get("function") or {}
    name = function.get("name")
    if call.get("type") != "function" or not call.get("id"):
        return f"no id or type 'function' ({call.get('id')!r}, {call.get('type')!r})"
    if name not in tools or (named is not None and name != named):
        return f"{name!r} is not " + (f"the named tool {named!r}" if named else "a listed tool")
    try:
        arguments = json.loads(function.get("arguments") or "")
    except ValueError as exc:
        return f"arguments are not JSON ({exc}): {function.get('arguments', '')[:80]!r}"
    schema = tools[name]["function"].get("parameters") or ANY_OBJECT
    return schema_problem(arguments, schema)


def answer_problem(answer: Answer, schema: dict[str, Any] | None) -> str | None:
    """Why `answer` is not JSON valid for `schema` (any object when None), or None."""
    ended = _ending_problem(answer, ("stop",))
    if ended or answer.calls:
        return ended or "a tool call instead of an answer"
    try:
        value = json.loads(answer.content or "")
    except ValueError as exc:
        return f"content is not JSON ({exc}): {(answer.content or '')[:80]!r}"
    return schema_problem(value, schema or ANY_OBJECT)


def schema_problem(instance: Any, schema: dict[str, Any]) -> str | None:
    """The most relevant error of `instance` against `schema` (its own draft, else 2020-12)."""
    validator = validators.validator_for(schema, default=Draft202012Validator)(schema)
    error = exceptions.best_match(validator.iter_errors(instance))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"not valid for the schema at /{where}: {error.message[:120]}"


def _ending_problem(answer: Answer, accepted: tuple[str, ...]) -> str | None:
    if answer.finish_reason == "length":
        return "cut by max_tokens (finish_reason length)"
    if answer.finish_reason not in accepted:
        return f"finish_reason {answer.finish_reason!r}"
    return None


def _markup(content: str | None) -> str | None:
    return next((m for m in MARKUP if content and m in content), None)
