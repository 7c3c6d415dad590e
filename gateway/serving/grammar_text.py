"""The Lark text of a request's output grammar (compiled by grammars.py, matched by the engine's
constraints.py).

What is constrained (`tool_grammar`, `json_grammar`):
- `tool_choice: "required"`: one call (several when `parallel_tool_calls` allows) to a listed
  tool, its arguments valid for that tool's schema; a named function: one call of that tool.
- `"auto"`: any text without the call's opening, or text then calls as above (Llama 3 writes a
  call as the whole output, so there it is text or calls).
- `response_format` (`json_schema`, `json_object`): one JSON value valid for the schema; with
  `"auto"` tools, that value or calls.

Arguments are written compactly (`", "` and `": "`, no other whitespace), as the families write
calls in their prompts. Objects that list `properties` (every required key among them) and say
nothing of `additionalProperties` are closed, and strings the schema leaves unbounded get a
`maxLength` (setting `max_string_chars`, 0: none; never below their `minLength`): an output valid
for the tightened schema is valid for the given one, a valid schema stays satisfiable, and a
small model no longer invents keys or repeats itself inside a string until `max_tokens` cuts the
call off (measured on the default model: "fuse_fuse_fuse..." for an email). The mask is applied
to the logits the same way on a hit, a miss and a bypass, so the cache still never changes the
output.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from adapters.base import CallSyntax, ToolSpec

JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")

Mode = Literal["required", "auto"]


def closed(schema: Any, max_string: int = 0) -> Any:
    """`schema` with every object that lists `properties` (and every key it requires) and says
    nothing of extra keys closed, and (with `max_string` > 0) every string it leaves unbounded
    given that `maxLength`, or its `minLength` when that is more."""
    if isinstance(schema, list):
        return [closed(s, max_string) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _closed_member(key, value, max_string) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out \
            and _lists_required(out):
        out["additionalProperties"] = False
    if max_string > 0 and _unbounded_string(out):  # never below minLength: a valid schema stays satisfiable
        least = out.get("minLength")
        out["maxLength"] = max(max_string, least) if isinstance(least, int) else max_string
    return out


def _lists_required(schema: dict[str, Any]) -> bool:
    """Every key the object requires is among its properties (else closing it leaves no instance)."""
    listed, required = schema.get("properties"), schema.get("required")
    names = required if isinstance(required, list) else []
    return isinstance(listed, dict) and all(name in listed for name in names)


def _unbounded_string(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    is_string = kind == "string" or (isinstance(kind, list) and "string" in kind)
    return is_string and not any(k in schema for k in ("maxLength", "enum", "const", "pattern", "format"))


_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_ITEMS = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "additionalProperties",
                 "contains", "if", "then", "else", "propertyNames", "unevaluatedProperties")


def _closed_member(key: str, value: Any, max_string: int) -> Any:
    if key in _SCHEMA_MAPS and isinstance(value, dict):
        return {name: closed(sub, max_string) for name, sub in value.items()}
    if key in _SCHEMA_ITEMS:
        return closed(value, max_string)
    return value


def json_rule(schema: dict[str, Any], max_string: int = 0) -> str:
    """A Lark rule body: a JSON value valid for `schema`, written compactly."""
    return "%json " + json.dumps({**closed(schema, max_string), "x-guidance": JSON_STYLE}, ensure_ascii=False)


def _lit(text: str, specials: dict[str, int]) -> str:
    """`text` as Lark: quoted literals, with the family's special-token markers as `<[id]>`."""
    parts: list[str] = []
    rest = text
    while rest:
        found = min(((rest.find(m), m) for m in specials if m in rest), default=None)
        if found is None:
            parts.append(json.dumps(rest))
            break
        at, marker = found
        if at:
            parts.append(json.dumps(rest[:at]))
        parts.append(f"<[{specials[marker]}]>")
        rest = rest[at + len(marker):]
    return " ".join(parts)


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else ("\\n" if c == "\n" else c) for c in text)


Rule = Callable[[dict[str, Any], int], str]  # json_rule, or a memo of it


def tool_grammar(syntax: CallSyntax, tools: Iterable[ToolSpec], *, mode: Mode, only: str | None = None,
                 parallel: bool = True, answer_schema: dict[str, Any] | None = None,
                 specials: dict[str, int] | None = None, max_string: int = 0,
                 free_tokens: Sequence[int] = (), rule: Rule = json_rule) -> str:
    """Lark for a tool-using turn's output (see the module doc); `only` names the one callable
    tool, `answer_schema` replaces free text in `"auto"` mode by a JSON answer."""
    specials = specials or {}
    listed = [t for t in tools if only is None or t.name == only]
    lines = []
    bodies = []
    for index, tool in enumerate(listed):
        bodies.append(f"body_{index}")
        lines.append(f"body_{index}: {_lit(json.dumps(tool.name), specials)} {_lit(syntax.name_to_args, specials)} "
                     f"args_{index} {_lit(syntax.call_close, specials)}")
        lines.append(f"args_{index}: {rule(tool.parameters or ANY_OBJECT, max_string)}")
    lines.append("body: " + " | ".join(bodies))
    more = f"({_lit(syntax.separator + syntax.call_open, specials)} body)*" if parallel and only is None else ""
    close = _lit(syntax.section_close, specials) if syntax.section_close else ""
    tail = f"body {more} {close}".strip()
    if mode == "required":
        lines.insert(0, f"start: {_lit(syntax.head, specials)} {tail}")
        return "\n".join(lines) + "\n"
    if answer_schema is not None:  # auto with structured output: the answer or calls
        lines.insert(0, f"start: answer | {_lit(syntax.head, specials)} {tail}")
        lines.append(f"answer: {rule(answer_schema, max_string)}")
    elif syntax.leading_only:  # text that does not open with a call, or calls
        lines.insert(0, f"start: PLAIN | {_lit(syntax.head, specials)} {tail}")
        lines.append(r"PLAIN: /(.|\n)*/ & ~/\s*" + _regex_literal(syntax.trigger) + r"(.|\n)*/")
    elif syntax.trigger in specials:  # the opening is one special token: text cannot contain it
        lines.insert(0, f"start: free | free {_lit(syntax.head, specials)} {tail}")
        lines.append(r"PLAIN: /(.|\n)+/")
        lines.append("free: (PLAIN | special)*")
    else:  # text without the opening; or text up to the opening (lazily: the first one), then calls
        rest = syntax.head[len(syntax.trigger):]
        lines.insert(0, f"start: free | pre {_lit(rest, specials) if rest else ''} {tail}")
        trigger = _regex_literal(syntax.trigger)
        lines.append(r"PLAIN: /(.|\n)+/ & ~/(.|\n)*" + trigger + r"(.|\n)*/")
        lines.append("free: (PLAIN | special)*")
        lines.append(r"pre[lazy]: /(.|\n)*" + trigger + "/")
    if mode == "auto" and answer_schema is None and not syntax.leading_only:
        # Free text is the model's own: special tokens it writes there (other than the end and a
        # call's opening) stay allowed, so "auto" text is what it would be without the grammar.
        marker_ids = set(specials.values())
        ids = sorted(t for t in free_tokens if t not in marker_ids)
        lines.append("special: " + (" | ".join(f"<[{t}]>" for t in ids) if ids else '""'))
    return "\n".join(lines) + "\n"


def json_grammar(schema: dict[str, Any], max_string: int = 0, rule: Rule = json_rule) -> str:
    """Lark for a structured answer: one JSON value valid for `schema`."""
    return f"start: answer\nanswer: {rule(schema, max_string)}\n"
