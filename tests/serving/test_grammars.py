"""The grammars constrained decoding uses, run token by token through llguidance on the real
SmolLM2 vocabulary and on a family tokenizer whose call marker is a special token: what each
tool_choice and response_format lets through, and what it refuses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from adapters.base import ChatMessage, ToolCallIn, ToolSpec
from adapters.families import get_family
from gateway.engine.constraints import GrammarLimit
from gateway.serving.grammars import GrammarError, Grammars
from gateway.serving.output_grammar import closed, json_grammar, tool_grammar
from tests.support.family_models import SETUPS, save_family_tokenizer

pytestmark = pytest.mark.model_free  # no model, no server: in the fast subset

ORDER = ToolSpec("get_order_details", "Get an order.",
                 {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]})
CANCEL = ToolSpec("cancel_order", "Cancel an order.",
                  {"type": "object", "properties": {"order_id": {"type": "string"},
                                                    "reason": {"enum": ["no longer needed", "ordered by mistake"]}},
                   "required": ["order_id", "reason"]})
TOOLS = (ORDER, CANCEL)


@pytest.fixture(scope="module")
def smol(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def grammars(smol: Any) -> Grammars:
    return Grammars(smol, len(smol), [smol.convert_tokens_to_ids("<|im_end|>")])


def follows(grammars: Grammars, tokenizer: Any, grammar: str, text: str, *, complete: bool = True) -> bool:
    """True when the grammar lets `text` through token by token (and, with `complete`, may end there)."""
    constraint = grammars.constraint(grammar, "test")
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        if not constraint.matcher.consume_token(token):
            return False
    return bool(constraint.matcher.is_accepting()) if complete else True


def calls_text(family: str, *calls: tuple[str, dict[str, Any]], content: str | None = None) -> str:
    turn = ChatMessage("assistant", content, tuple(ToolCallIn("", n, json.dumps(a)) for n, a in calls))
    return get_family(family).assistant_text(turn)


@pytest.mark.parametrize("family", ["chatml", "llama3", "mistral"])
def test_required_lets_through_a_valid_call_and_nothing_else(grammars, smol, family):
    syntax = get_family(family).call_syntax()
    grammar = tool_grammar(syntax, TOOLS, mode="required")
    good = calls_text(family, ("cancel_order", {"order_id": "W1", "reason": "ordered by mistake"}))
    assert follows(grammars, smol, grammar, good)
    two = calls_text(family, ("get_order_details", {"order_id": "W1"}), ("get_order_details", {"order_id": "W2"}))
    assert follows(grammars, smol, grammar, two)
    assert not follows(grammars, smol, grammar, "Sure, I can help.", complete=False)
    assert not follows(grammars, smol, grammar, calls_text(family, ("delete_everything", {})), complete=False)
    bad_enum = calls_text(family, ("cancel_order", {"order_id": "W1", "reason": "because"}))
    assert not follows(grammars, smol, grammar, bad_enum, complete=False)
    missing = calls_text(family, ("cancel_order", {"order_id": "W1"}))
    assert not follows(grammars, smol, grammar, missing)
    invented_key = calls_text(family, ("get_order_details", {"order_id": "W1", "city": "Paris"}))
    assert not follows(grammars, smol, grammar, invented_key, complete=False)


@pytest.mark.parametrize("family", ["chatml", "mistral"])
def test_auto_lets_text_through_and_holds_a_call_once_it_opens(grammars, smol, family):
    grammar = tool_grammar(get_family(family).call_syntax(), TOOLS, mode="auto")
    assert follows(grammars, smol, grammar, "Your order ships tomorrow. Anything else?")
    with_text = calls_text(family, ("get_order_details", {"order_id": "W1"}), content="Let me check.")
    assert follows(grammars, smol, grammar, with_text)
    broken = calls_text(family, ("get_order_details", {"order_id": "W1"})).replace('"W1"', "W1")
    assert not follows(grammars, smol, grammar, broken, complete=False)


def test_llama3_auto_is_text_or_calls_never_text_then_calls(grammars, smol):
    grammar = tool_grammar(get_family("llama3").call_syntax(), TOOLS, mode="auto")
    assert follows(grammars, smol, grammar, "Your order ships tomorrow.")
    assert follows(grammars, smol, grammar, calls_text("llama3", ("get_order_details", {"order_id": "W1"})))
    assert not follows(grammars, smol, grammar, '{"name": "get_order_details", "parameters": W1', complete=False)


def test_a_named_function_or_parallel_false_allows_one_call(grammars, smol):
    syntax = get_family("chatml").call_syntax()
    one = calls_text("chatml", ("get_order_details", {"order_id": "W1"}))
    two = calls_text("chatml", ("get_order_details", {"order_id": "W1"}), ("get_order_details", {"order_id": "W2"}))
    named = tool_grammar(syntax, TOOLS, mode="required", only="get_order_details")
    assert follows(grammars, smol, named, one) and not follows(grammars, smol, named, two, complete=False)
    assert not follows(grammars, smol, named, calls_text("chatml", ("cancel_order", {})), complete=False)
    single = tool_grammar(syntax, TOOLS, mode="required", parallel=False)
    assert follows(grammars, smol, single, one) and not follows(grammars, smol, single, two, complete=False)


def test_the_forced_opening_is_consumed_before_generation(grammars, smol):
    syntax = get_family("chatml").call_syntax()
    opening = get_family("chatml").call_opening("get_order_details")
    forced = smol(opening, add_special_tokens=False)["input_ids"]
    constraint = grammars.constraint(tool_grammar(syntax, TOOLS, mode="required", only="get_order_details"),
                                     "tools", forced)
    rest = smol('{"order_id": "W1"}}\n</tool_call>', add_special_tokens=False)["input_ids"]
    assert all(constraint.matcher.consume_token(t) for t in rest) and constraint.matcher.is_accepting()


def test_a_structured_answer_is_json_valid_for_the_schema(grammars, smol):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    grammar = json_grammar(schema)
    assert follows(grammars, smol, grammar, '{"name": "Ann", "age": 31}')
    assert not follows(grammars, smol, grammar, '{"name": "Ann", "age": "31"}', complete=False)
    assert not follows(grammars, smol, grammar, "Here is the JSON:", complete=False)
    assert not follows(grammars, smol, grammar, '{"name": "Ann"}')


def test_auto_with_a_structured_answer_is_the_answer_or_calls(grammars, smol):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    grammar = tool_grammar(get_family("chatml").call_syntax(), TOOLS, mode="auto", answer_schema=schema)
    assert follows(grammars, smol, grammar, '{"answer": "tomorrow"}')
    assert follows(grammars, smol, grammar, calls_text("chatml", ("get_order_details", {"order_id": "W1"})))
    assert not follows(grammars, smol, grammar, "tomorrow", complete=False)


def test_a_special_token_marker_is_matched_as_that_token(tokenizer_dir, tmp_path):
    """Mistral's `[TOOL_CALLS]` is one special token: the grammar must ask for that token, not its text."""
    tokenizer = AutoTokenizer.from_pretrained(save_family_tokenizer(SETUPS["mistral"], tokenizer_dir, tmp_path))
    marker = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    eos = tokenizer.convert_tokens_to_ids("</s>")
    grammars = Grammars(tokenizer, len(tokenizer), [eos])
    syntax = get_family("mistral").call_syntax()
    for mode in ("required", "auto"):
        grammar = tool_grammar(syntax, TOOLS, mode=mode, specials={"[TOOL_CALLS]": marker})  # type: ignore[arg-type]
        text = calls_text("mistral", ("get_order_details", {"order_id": "W1"}))
        assert tokenizer(text, add_special_tokens=False)["input_ids"][0] == marker
        assert follows(grammars, tokenizer, grammar, text)


def test_a_schema_the_engine_cannot_use_is_a_grammar_error_naming_the_field(grammars):
    with pytest.raises(GrammarError) as raised:
        grammars.constraint(json_grammar({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
                            "response_format")
    assert raised.value.param == "response_format"


def test_grammars_are_compiled_once_and_copied_per_request(smol):
    grammars = Grammars(smol, len(smol), [smol.convert_tokens_to_ids("<|im_end|>")])
    grammar = tool_grammar(get_family("chatml").call_syntax(), TOOLS, mode="required")
    first, second = grammars.constraint(grammar, "tools"), grammars.constraint(grammar, "tools")
    assert grammars.compiles == 1
    ids = smol('<tool_call>\n{"name": "get_order_details"', add_special_tokens=False)["input_ids"]
    assert first.matcher.consume_tokens(ids)  # the copies do not share state
    assert second.matcher.consume_tokens(smol('<tool_call>\n{"name": "cancel_order"',
                                              add_special_tokens=False)["input_ids"])


def test_closing_objects_keeps_outputs_valid_for_the_open_schema():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}},
                                               "c": {"type": "array", "items": {"type": "object",
                                                                                "properties": {"d": {}}}}},
              "$defs": {"e": {"type": "object", "properties": {"f": {}}}}}
    tight = closed(schema)
    assert tight["additionalProperties"] is False
    assert tight["properties"]["a"]["additionalProperties"] is False
    assert tight["properties"]["c"]["items"]["additionalProperties"] is False
    assert tight["$defs"]["e"]["additionalProperties"] is False
    assert "additionalProperties" not in closed({"type": "object", "additionalProperties": {"type": "string"},
                                                 "properties": {}})["properties"]
    instance = {"a": {"b": "x"}, "c": [{"d": 1}]}
    jsonschema.validate(instance, tight)
    jsonschema.validate(instance, schema)


def test_tightening_never_leaves_a_valid_schema_without_an_instance():
    """The string bound never goes below a minLength, and an object requiring a key it does not
    list stays open (closed, it would have no instance)."""
    assert closed({"type": "string", "minLength": 300}, 256)["maxLength"] == 300
    assert closed({"type": "string", "minLength": 3}, 256)["maxLength"] == 256
    schema = {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}
    assert "additionalProperties" not in closed(schema)
    jsonschema.validate({"a": 1, "b": 2}, closed(schema))


def test_a_hundred_tool_grammar_allows_only_the_call_opening_first(grammars: Grammars, smol: Any,
                                                                   merchant_tools: list[dict[str, Any]]) -> None:
    """The 100 merchant tools compile into one grammar (its cost is the bench's to measure)."""
    tools = [ToolSpec(t["function"]["name"] if "function" in t else t["name"], None,
                      (t.get("function") or t).get("parameters")) for t in merchant_tools]
    grammar = tool_grammar(get_family("chatml").call_syntax(), tools, mode="required")
    constraint = grammars.constraint(grammar, "tools")
    masked = constraint.mask(torch.zeros(len(smol)))
    allowed = torch.isfinite(masked).nonzero().flatten().tolist()
    assert allowed and all(smol.decode([t]) and "<tool_call>".startswith(smol.decode([t])) for t in allowed)



def _wide(properties: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}


def test_an_object_with_hundreds_of_optional_properties_is_served(grammars, smol):
    """llguidance's default row limit (2,000 items, ~500 optional properties) failed a 600-property
    answer on its first token; OpenAI's structured outputs take up to 5,000 properties."""
    constraint = grammars.constraint(json_grammar(_wide(600)), "response_format")
    for token in smol('{"p7": "a", "p599": "b"}', add_special_tokens=False)["input_ids"]:
        constraint.prepare()
        constraint.accept(token)
    assert not constraint.matcher.is_error()


def test_an_object_past_the_grammar_limits_is_the_requests_fault_naming_its_field(grammars, smol):
    """Past the raised limit, following the output stops with a GrammarLimit (a 400 naming the
    field), not a ConstraintViolation (a server fault)."""
    constraint = grammars.constraint(json_grammar(_wide(3000)), "response_format")
    with pytest.raises(GrammarLimit) as raised:
        for token in smol('{"p1": "a"}', add_special_tokens=False)["input_ids"]:
            constraint.prepare()
            constraint.accept(token)
    assert raised.value.param == "response_format"
    assert "'response_format' schema is too large" in str(raised.value)
