"""Each family, on a tokenizer speaking its format: detection, tools reaching the prompt tokens,
multi-turn tool turns in the family's format, and one tool-group prefix for a whole agent loop."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig, AutoTokenizer

from adapters.base import ChatMessage, ToolCallIn, ToolSpec
from adapters.families import ADAPTER_VERSION, detect_family, family_names, get_family
from adapters.hermes import CHATML_TEMPLATE
from adapters.render import PromptRenderer
from gateway.engine.model_info import ModelInfo
from gateway.errors import BadRequest
from gateway.metrics import Metrics
from gateway.protocol.chat import ChatCompletionRequest
from gateway.serving.answers import Prepared
from gateway.serving.service import ChatService
from tests.conftest import WORKLOADS
from tests.support.family_models import SETUPS
from tests.support.toolcalls import ParsedToolCall, get_parser

FAMILY_SETUPS = list(SETUPS)
# How each family writes a tool result in the prompt.
RESULT_MARKERS = {"chatml": "<tool_response>", "chatml-native": "<tool_response>",
                  "llama3": "<|start_header_id|>ipython<|end_header_id|>", "mistral": "[TOOL_RESULTS]"}


def tau_turns(task_id: int, count: int) -> list[dict[str, Any]]:
    """Consecutive recorded turns of one airline task: the same tool group, a growing history."""
    lines = (WORKLOADS / "tau_bench" / "airline_trajectory_turns.head150.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return [r for r in rows if r["task_id"] == task_id and r["trial"] == 0][:count]


@pytest.fixture(scope="module")
def service(family_model_dir):
    """service(setup) -> ChatService for that model's tokenizer; `prepare` never needs the engine."""
    made: dict[str, ChatService] = {}

    def make(name: str) -> ChatService:
        if name not in made:
            model_dir: Path = family_model_dir(name)
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            family = detect_family(AutoConfig.from_pretrained(model_dir).model_type, tokenizer.chat_template)
            made[name] = ChatService(None, ModelInfo.of(None, tokenizer), tokenizer, family,  # type: ignore[arg-type]
                                     "m", 16384, Metrics(), cache_enabled=True, default_max_tokens=8)
        return made[name]

    return make


def prepare(svc: ChatService, body: dict[str, Any]) -> Prepared:
    return svc.prepare(ChatCompletionRequest.model_validate(body))


def decoded(svc: ChatService, ids: list[int]) -> str:
    return str(svc.tokenizer.decode(ids))


# ---- detection ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILY_SETUPS)
def test_family_is_detected_from_the_chat_template(service, name):
    assert service(name).family.name == SETUPS[name].family


@pytest.mark.parametrize("model_type, template, family", [
    ("mistral", CHATML_TEMPLATE, "chatml"),  # OpenHermes-Mistral: a ChatML template wins
    ("mistral", None, "mistral"), ("mixtral", None, "mistral"),
    ("llama", None, "chatml"), ("qwen2", None, "chatml"),
    ("llama", {"default": "<|start_header_id|>{{ x }}", "tool_use": "..."}, "llama3"),
])
def test_without_a_telling_template_the_model_type_decides(model_type, template, family):
    assert detect_family(model_type, template).name == family


def test_settings_can_name_any_family():
    assert family_names() == ("chatml", "llama3", "mistral")
    with pytest.raises(ValueError, match="chatml, llama3, mistral"):
        get_family("gemma")


# ---- the tool group reaches the model, at the head -----------------------------------------


@pytest.mark.parametrize("name", FAMILY_SETUPS)
def test_every_tool_name_is_in_the_cached_prefix_tokens(service, name, merchant_tools):
    svc = service(name)
    tools = merchant_tools[:12]
    prepared = prepare(svc, {"messages": [{"role": "system", "content": "You are a merchant assistant."},
                                          {"role": "user", "content": "GMV last week?"}], "tools": tools})
    prefix = decoded(svc, prepared.job.prompt_ids[: prepared.job.prefix_len])
    assert prepared.job.prefix_len > 100
    assert "You are a merchant assistant." in prefix
    for tool in tools:
        assert tool["function"]["name"] in prefix
    assert "GMV last week?" in decoded(svc, prepared.job.prompt_ids[prepared.job.prefix_len:])


def test_mistral_uses_its_own_template_because_the_models_puts_tools_last(service):
    svc = service("mistral")
    assert svc.renderer.template == svc.family.tools_template
    prepared = prepare(svc, {"messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "hi"}],
                             "tools": [{"type": "function", "function": {"name": "ping"}}]})
    text = decoded(svc, prepared.job.prompt_ids)
    assert text.startswith('<s>[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "ping"}}]'
                           "[/AVAILABLE_TOOLS][INST] Be brief.\n\nhi[/INST]")


def test_llama3_tools_in_the_first_user_turn_are_cut_before_its_text(service, merchant_tools):
    svc = service("llama3")
    prepared = prepare(svc, {"messages": [{"role": "user", "content": "Refunds today?"}],
                             "tools": merchant_tools[:3]})
    prefix = decoded(svc, prepared.job.prompt_ids[: prepared.job.prefix_len])
    assert prefix.rstrip().endswith("}")  # the last tool's JSON; the user's words come after the cut
    assert "Refunds" not in prefix


# ---- agent loops: multi-turn rendering and one prefix ---------------------------------------


@pytest.mark.parametrize("name", FAMILY_SETUPS)
def test_agent_loop_turns_render_tool_turns_and_share_one_prefix(service, name):
    svc = service(name)
    turns = tau_turns(task_id=0, count=4)
    prepared = [prepare(svc, {"messages": t["messages"], "tools": t["tools"]}) for t in turns]
    first = prepared[0].job
    for later in prepared[1:]:
        assert later.job.prefix_len == first.prefix_len > 1000
        assert later.job.prompt_ids[: later.job.prefix_len] == first.prompt_ids[: first.prefix_len]
    history = turns[-1]["messages"]
    calls = [c["function"] for m in history for c in m.get("tool_calls") or ()]
    assert calls and any(m["role"] == "tool" for m in history)
    suffix = decoded(svc, prepared[-1].job.prompt_ids[prepared[-1].job.prefix_len:])
    for call in calls:
        assert svc.family.call_opening(call["name"]) in suffix
    assert RESULT_MARKERS[name] in suffix


def test_llama3_writes_several_calls_itself_when_its_template_refuses_them(service):
    svc = service("llama3")
    two_calls = [{"id": f"call_{n}", "type": "function", "function": {"name": n, "arguments": '{"x": 1}'}}
                 for n in ("get_a", "get_b")]
    prepared = prepare(svc, {"messages": [
        {"role": "user", "content": "both"}, {"role": "assistant", "content": None, "tool_calls": two_calls},
        {"role": "tool", "tool_call_id": "call_get_a", "content": "1"},
        {"role": "tool", "tool_call_id": "call_get_b", "content": "2"}],
        "tools": [{"type": "function", "function": {"name": n}} for n in ("get_a", "get_b")]})
    text = decoded(svc, prepared.job.prompt_ids)
    assert '{"name": "get_a", "parameters": {"x": 1}}; {"name": "get_b", "parameters": {"x": 1}}' in text


def test_a_conversation_the_template_cannot_render_is_a_400(service):
    with pytest.raises(BadRequest, match="chat template cannot render") as info:
        prepare(service("llama3"), {"messages": [{"role": "system", "content": "tools but no user"}],
                                    "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert info.value.param == "messages"


# ---- the family's call syntax round-trips through its parser --------------------------------


@pytest.mark.parametrize("family", ["chatml", "llama3", "mistral"])
def test_forced_openings_start_the_whole_call_and_calls_parse_back(family):
    fam = get_family(family)
    whole = fam.call_text("get_order", '{"order_id": "#W1", "n": 2}')
    assert whole.startswith(fam.call_opening("get_order"))
    assert whole.startswith(fam.call_opening(None))
    parsed = get_parser(fam.tool_parser).parse(whole)
    assert parsed.tool_calls == (ParsedToolCall("get_order", '{"order_id": "#W1", "n": 2}'),)
    assert parsed.content is None


@pytest.mark.parametrize("family", ["chatml", "llama3", "mistral"])
def test_a_history_turn_with_several_calls_is_what_the_parser_reads(family):
    fam = get_family(family)
    turn = ChatMessage("assistant", None, (ToolCallIn("call_1", "a", '{"x": 1}'), ToolCallIn("call_2", "b", "{}")))
    parsed = get_parser(fam.tool_parser).parse(fam.assistant_text(turn))
    assert parsed.tool_calls == (ParsedToolCall("a", '{"x": 1}'), ParsedToolCall("b", "{}"))


@pytest.mark.parametrize("parameters, expected", [
    (None, True), ({"type": "object", "properties": {}}, True),
    ({"type": "object", "properties": {}, "required": [], "additionalProperties": False}, True),
    ({"type": "object", "properties": {"id": {"type": "string"}}}, False),
    ({"type": "object", "additionalProperties": {"type": "string"}}, False),
    ({"type": "object", "additionalProperties": True}, False),
    ({"$ref": "#/$defs/args", "$defs": {"args": {"type": "object"}}}, False),  # the grammar judges these
    ({"allOf": [{"type": "object"}]}, False), ({"anyOf": [{"type": "object"}]}, False),
    ({"type": "object", "required": ["id"]}, False), ({"type": "object", "minProperties": 1}, False),
    ({"type": "string"}, False),
])
def test_a_function_takes_no_arguments_only_when_nothing_can_be_passed(parameters, expected):
    assert ToolSpec("f", None, parameters).takes_no_arguments is expected


# ---- rendering is part of every cache key ----------------------------------------------------

# (ADAPTER_VERSION, fingerprint of everything the adapters write) — move both together.
RENDERING_PIN = ("2", "11d346d200cc9c6a")


def rendering_fingerprint(tokenizer_dir: Path) -> str:
    """Everything the families write, plus a full SmolLM2 render; changes when rendering does."""
    tools = (ToolSpec("get_order", "Get an order.", {"type": "object", "properties": {"id": {"type": "string"}}}),
             ToolSpec("ping", None, None), ToolSpec("a", None, None))  # "a": name and size orders differ
    call_turn = ChatMessage("assistant", "ok", (ToolCallIn("call_abcdefghijk", "get_order", '{"id": "7"}'),))
    result = ChatMessage("tool", '{"status": "shipped"}', tool_call_id="call_abcdefghijk")
    parts: list[Any] = []
    for name in family_names():
        fam = get_family(name)
        parts += [name, fam.tools_block(tools), fam.assistant_text(call_turn), fam.tool_result_text(result),
                  fam.call_opening(None), fam.call_opening("ping"), fam.default_template, fam.tools_template,
                  fam.tool_result_role]
    smollm = PromptRenderer(AutoTokenizer.from_pretrained(tokenizer_dir), get_family("chatml"))
    rendered = smollm.render([ChatMessage("system", "Be brief."), ChatMessage("user", "Where is 7?"), call_turn,
                              result], list(tools))
    parts += [rendered.text, rendered.prefix_chars]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def test_rendering_changes_come_with_an_adapter_version_bump(tokenizer_dir):
    assert (ADAPTER_VERSION, rendering_fingerprint(tokenizer_dir)) == RENDERING_PIN, (
        "what the adapters write changed: cached prefixes rendered the old way must not be served "
        "for the new one. Bump ADAPTER_VERSION in adapters/families.py, then update this pin.")

