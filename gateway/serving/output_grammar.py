"""What a request's output is held to: the call `tool_choice` forces, the grammar its tokens
follow (tools, `response_format`: grammar_text.py, compiled per tenant by grammars.py into the
engine's `Constraint`), and where stop sequences stop applying."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapters.base import ChatFamily, ToolSpec
from gateway.engine import Constraint, Tokenizer
from gateway.engine.model_info import ModelInfo
from gateway.errors import BadRequest
from gateway.protocol.generation import FieldNames, GenerationRequest
from gateway.serving.checks import forced_name, special_markers
from gateway.serving.finite_schemas import has_finite_instance
from gateway.serving.grammar_text import Mode, Rule, json_grammar, json_rule, tool_grammar
from gateway.serving.grammars import GRAMMAR_CACHE_BYTES, GrammarError, Grammars
from gateway.serving.jobs import ForcedCall
from gateway.serving.schema_memo import SchemaMemo


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
        """The grammar this request's output must follow (grammar_text.py), having
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
