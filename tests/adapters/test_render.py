"""Rendering with the real SmolLM2 tokenizer: tools reach the model, the cut is exact, and the
tool group is canonical."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from adapters.base import ChatMessage, ToolSpec
from adapters.hermes import HermesFamily
from adapters.render import PromptRenderer


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def specs(tools):
    return [ToolSpec(t["function"]["name"], t["function"].get("description"), t["function"].get("parameters"))
            for t in tools]


CHAT = [ChatMessage("system", "You are a shop assistant."), ChatMessage("user", "GMV last week?")]


def test_smollm_template_drops_tools_so_the_adapter_writes_them(tokenizer, merchant_tools):
    renderer = PromptRenderer(tokenizer, HermesFamily())
    assert not renderer.native_tools
    prompt = renderer.render(CHAT, specs(merchant_tools[:20]))
    ids = tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
    decoded = tokenizer.decode(ids)
    for tool in merchant_tools[:20]:
        assert tool["function"]["name"] in decoded
    assert prompt.text.endswith("<|im_start|>assistant\n")


def test_prefix_cut_equals_tokenizing_the_prefix_alone(tokenizer, merchant_tools):
    prompt = PromptRenderer(tokenizer, HermesFamily()).render(CHAT, specs(merchant_tools[:20]))
    enc = tokenizer(prompt.text, add_special_tokens=False, return_offsets_mapping=True)
    cut = sum(1 for _, end in enc["offset_mapping"] if end <= prompt.prefix_chars)
    alone = tokenizer(prompt.text[: prompt.prefix_chars], add_special_tokens=False)["input_ids"]
    assert enc["input_ids"][:cut] == alone
    assert prompt.text[: prompt.prefix_chars].endswith("<|im_end|>\n")


def test_tool_order_does_not_change_the_prefix_but_content_does(tokenizer, merchant_tools):
    renderer = PromptRenderer(tokenizer, HermesFamily())
    tools = specs(merchant_tools[:6])
    a = renderer.render(CHAT, tools)
    b = renderer.render(CHAT, list(reversed(tools)))
    c = renderer.render([ChatMessage("system", "Other prompt."), CHAT[1]], tools)
    assert a.text[: a.prefix_chars] == b.text[: b.prefix_chars]
    assert a.group.group_id == b.group.group_id != c.group.group_id
    assert a.text[: a.prefix_chars] != c.text[: c.prefix_chars]


def test_agent_loop_turns_keep_the_same_prefix(tokenizer, merchant_tools):
    renderer = PromptRenderer(tokenizer, HermesFamily())
    from adapters.base import ToolCallIn

    turn1 = renderer.render(CHAT, specs(merchant_tools[:4]))
    turn2 = renderer.render(CHAT + [
        ChatMessage("assistant", None, (ToolCallIn("call_1", "gmv_summary", '{"start_date": "2024-01-01"}'),)),
        ChatMessage("tool", '{"gmv": 10}', tool_call_id="call_1"),
    ], specs(merchant_tools[:4]))
    assert turn1.text[: turn1.prefix_chars] == turn2.text[: turn2.prefix_chars]
    assert "<tool_response>" in turn2.text and "gmv_summary" in turn2.text[turn2.prefix_chars:]


@pytest.mark.parametrize("arguments", ['{"a": "\\ud800"}', '{"a": NaN}', "[Infinity]", '{"a": 1e400}',
                                       "[NaN," + "[" * 5000 + "]" * 5000 + "]"])
def test_call_arguments_that_are_not_strict_json_are_written_as_the_client_sent_them(tokenizer, arguments):
    """Python's parser takes these (a lone surrogate, NaN, an infinity, nesting past its recursion
    limit once parsed): as objects they could not be tokenized, or would not be the client's text."""
    from adapters.base import ToolCallIn

    history = [*CHAT, ChatMessage("assistant", None, (ToolCallIn("call_1", "f", arguments),)),
               ChatMessage("tool", "42", tool_call_id="call_1")]
    prompt = PromptRenderer(tokenizer, HermesFamily()).render(history, [])
    assert f'"arguments": {json.dumps(arguments, ensure_ascii=False)}' in prompt.text  # the text, as a string
    tokenizer(prompt.text, add_special_tokens=False)  # a lone surrogate in the text would raise here


def test_call_arguments_keep_integers_past_64_bits_exact(tokenizer):
    from adapters.base import ToolCallIn

    call = ToolCallIn("call_1", "f", '{"id": 123456789012345678901234567890}')
    history = [*CHAT, ChatMessage("assistant", None, (call,)), ChatMessage("tool", "42", tool_call_id="call_1")]
    prompt = PromptRenderer(tokenizer, HermesFamily()).render(history, [])
    assert '"id": 123456789012345678901234567890' in prompt.text
