"""What a request's output is held to: the call `tool_choice` forces, the grammar its tokens
follow (tools, `response_format`; compiled per tenant by grammars.py into the engine's
`Constraint`), and where stop sequences stop applying; and the checks a request passes before
any grammar is built or token generated (they are what makes a grammar possible): unique tool
names, schemas with a finite instance, a `tool_choice` that names listed tools.

The grammar's Lark text (compiled by grammars.py, matched by the engine's constraints.py).

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
from dataclasses import dataclass
from typing import Any, Literal

from adapters.base import CallSyntax, ChatFamily, ToolSpec
from gateway.engine import Constraint, Tokenizer
from gateway.engine.model_info import ModelInfo
from gateway.errors import BadRequest
from gateway.protocol.generation import CHAT_FIELDS, FieldNames, GenerationRequest
from gateway.serving.finite_schemas import has_finite_instance
from gateway.serving.grammars import GRAMMAR_CACHE_BYTES, GrammarError, Grammars, SchemaMemo


@dataclass(frozen=True, slots=True)
class ForcedCall:
    """`tool_choice` as text after the generation prompt, as if the model had written it."""

    opening: str = ""
    complete: bool = False  # the whole call: a named function that takes no arguments


# ---- the checks before any grammar ------------------------------------------------------------


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


# ---- the family's call markers in this vocabulary ---------------------------------------------


def marker_ids(tokenizer: Tokenizer, markers: tuple[str, ...]) -> frozenset[int]:
    """Ids of the family's call markers that are single tokens in this vocabulary."""
    vocab = tokenizer.get_vocab()
    return frozenset(vocab[m] for m in markers if m in vocab)


def special_markers(tokenizer: Tokenizer, markers: tuple[str, ...], special: frozenset[int]) -> dict[str, int]:
    """The family's call markers that are special tokens here: a grammar names them by id."""
    vocab = tokenizer.get_vocab()
    return {m: vocab[m] for m in markers if m in vocab and vocab[m] in special}


class OutputGrammar:
    def __init__(self, tokenizer: Tokenizer, info: ModelInfo, family: ChatFamily, *, max_string_chars: int = 0,
                 reserve_tokens: int = 0, grammar_cache_bytes: int = GRAMMAR_CACHE_BYTES) -> None:
        self.family = family
        self.grammars = Grammars(tokenizer, info.vocab_size, info.eos_ids, grammar_cache_bytes)  # per tenant
        self.call_specials = special_markers(tokenizer, family.call_markers, info.special_ids)
        self.max_string_chars = max_string_chars  # the bound on strings a schema leaves unbounded
        self.reserve_tokens = reserve_tokens  # a constrained output's last tokens steer to its end
        # special tokens "auto" free text may hold, as without a grammar (not the end of the output)
        self.free_specials = tuple(sorted(info.special_ids - info.eos_ids))
        self.schemas = SchemaMemo()  # each schema's grammar rule and finite check, per tenant

    def finite(self, tenant: str) -> Callable[[Any], bool]:
        """`has_finite_instance`, remembered per schema in `tenant`'s namespace."""
        return lambda schema: self.schemas.get("finite", tenant, schema, lambda: has_finite_instance(schema))

    def rule(self, tenant: str) -> Rule:
        """`json_rule`, remembered per schema (and string bound) in `tenant`'s namespace."""
        return lambda schema, max_string: self.schemas.get(f"rule:{max_string}", tenant, schema,
                                                           lambda: json_rule(schema, max_string))

    def forced_call(self, req: GenerationRequest, tools: list[ToolSpec]) -> ForcedCall:
        """`required` forces the opening of some call; a named function (or `required` with one
        tool) forces the opening with its name, or the whole call when it takes no arguments."""
        name = forced_name(req, tools)
        if name is None:
            required = req.tool_mode == "required" and bool(tools)
            return ForcedCall(self.family.call_opening(None) if required else "")
        if next(t for t in tools if t.name == name).takes_no_arguments:
            return ForcedCall(self.family.call_text(name), complete=True)
        return ForcedCall(self.family.call_opening(name))

    def constraint(self, req: GenerationRequest, tools: tuple[ToolSpec, ...], tools_active: bool,
                   forced_ids: list[int], max_tokens: int, tenant: str = "") -> Constraint | None:
        """The grammar this request's output must follow (the Lark text below), having
        consumed the forced opening; None when the output is free text. Compiled grammars are
        reused only within `tenant` (no cross-tenant timing)."""
        answer, names = req.answer_schema, req.fields
        mode: Mode = "auto"
        if tools_active:
            only = forced_name(req, list(tools))
            mode = "required" if req.tool_mode == "required" else "auto"
            callable_tools = [t for t in tools if req.tool_choice.may_call(t.name)]  # all still in the prompt
            grammar = tool_grammar(self.family.call_syntax(), callable_tools, mode=mode, only=only,
                                   parallel=req.parallel_tool_calls,
                                   answer_schema=answer, specials=self.call_specials,
                                   max_string=self.max_string_chars, free_tokens=self.free_specials,
                                   rule=self.rule(tenant))
            param = names.tools
        elif answer is not None:
            # the schema's own path, as the finite-instance check names it (json_object has no schema)
            param = names.answer_schema if req.answer_schema_given else names.response_format
            grammar = json_grammar(answer, self.max_string_chars, self.rule(tenant))
        else:
            return None
        try:
            # the reserve is at most a quarter of the budget, so a short answer is not all closing
            # ... and never in "auto" free text: steering would end the model's own answer early
            free_text = tools_active and mode == "auto" and answer is None
            closing = (max_tokens - min(self.reserve_tokens, max_tokens // 4)
                       if self.reserve_tokens and not free_text else None)
            return self.grammars.constraint(grammar, param, forced_ids, closing, namespace=tenant)
        except GrammarError as exc:
            raise BadRequest(str(exc), param=self._bad_schema(tools, exc.param, names, tenant)) from None

    def _bad_schema(self, tools: tuple[ToolSpec, ...], param: str, names: FieldNames, tenant: str = "") -> str:
        """The first tool whose schema alone does not compile (`tools[i].function.parameters`)."""
        if param != names.tools:
            return param
        for index, tool in enumerate(tools):
            try:
                self.grammars.constraint(json_grammar(tool.parameters or {"type": "object"}), "tools",
                                         namespace=tenant)
            except GrammarError:
                return names.tool_parameters.format(index)
        return param

    def stop_before(self, forced_opening: str) -> str:
        """Where stop sequences stop applying (the engine's `Job.stop_before`): at the trigger of
        the family's call section, or nowhere when the output starts inside a forced call. The
        grammar holds a call to its schema; a stop sequence matching inside it would cut it into
        arguments that are not JSON, reported as a finished call."""
        return "" if forced_opening else self.family.call_syntax().trigger

    def warm_up(self, tool: ToolSpec) -> None:
        """llguidance's one-time work (the vocabulary's view, the closing sets) and a first
        compile, with a grammar for `tool`; nothing is kept."""
        self.grammars.warm_up(tool_grammar(self.family.call_syntax(), [tool], mode="auto",
                                           specials=self.call_specials, free_tokens=self.free_specials))


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
