"""Conversation reuse needs rendering that is stable across turns: turn k+1 of an agent loop may
reuse the KV of turn k's prompt tokens only up to the first token that differs, so turn k's
prompt, less its trailing generation prompt, must be a token prefix of turn k+1's.

Checked per family on the real tau-bench airline histories (consecutive recorded turns of a task:
each adds the assistant's answer or tool call, tool results and/or the user's next message), with
the family tokenizers of tests/support/family_models.py: SmolLM2's vocabulary plus each family's special
tokens and a template in the shape of its real one (chatml: SmolLM2's own, which drops tools;
chatml-native: Qwen2.5; llama3: Llama 3.1; mistral: Mistral 7B v0.3).

Also pinned: the token that opens each message (the engine cuts prompt chunks at turn markers),
and, where a family is not stable, exactly where and why.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Regex, pre_tokenizers
from transformers import AutoTokenizer

from adapters.base import ChatMessage, ToolSpec
from adapters.families import detect_family
from adapters.render import PromptRenderer, RenderError
from gateway.protocol.chat import ChatCompletionRequest
from gateway.serving.prompt_tokens import PromptTokenizer
from tests.conftest import WORKLOADS
from tests.support.family_models import SETUPS, save_family_tokenizer

TURNS = WORKLOADS / "tau_bench" / "airline_trajectory_turns.head150.jsonl"
AIRLINE_TOOLS = json.loads((WORKLOADS / "tau_bench" / "tools_airline.json").read_text())
RECORDED_PAIRS = 128  # consecutive recorded turns of one task, over the 22 tasks of the file

GENERATION_PROMPTS = {"chatml": "<|im_start|>assistant\n",
                      "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
                      "mistral": ""}  # Mistral's format has none: the answer follows [/INST] or [/TOOL_RESULTS]
TEXT = "text"  # a message that opens with ordinary text, not with a special token

Messages = list[dict[str, Any]]


def conversations() -> list[list[Messages]]:
    """Each recorded task's turns (the messages of each request), in turn order."""
    by_task: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for row in map(json.loads, TURNS.read_text().splitlines()):
        by_task[(row["task_id"], row["trial"])].append(row)
    return [[r["messages"] for r in sorted(rows, key=lambda r: r["turn_index"])] for rows in by_task.values()]


def chat(messages: Messages) -> tuple[list[ChatMessage], list[ToolSpec]]:
    """Wire messages and the airline tools as the gateway hands them to the renderer."""
    req = ChatCompletionRequest.model_validate({"messages": messages, "tools": AIRLINE_TOOLS})
    return [m.to_chat() for m in req.messages], [t.to_spec() for t in req.tools or ()]


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # as the engine gets them (gateway.serving.prompt_tokens)
    prefix_len: int  # the tool group's tokens
    body_len: int  # the tokens before the generation prompt

    @property
    def body_ids(self) -> list[int]:
        return self.ids[: self.body_len]


class Family:
    def __init__(self, tokenizer: Any, arch: str) -> None:
        self.tokenizer = tokenizer
        self.renderer = PromptRenderer(tokenizer, detect_family(arch, tokenizer.chat_template))
        self.prompt_tokens = PromptTokenizer(tokenizer)
        self.generation_prompt = GENERATION_PROMPTS[self.renderer.family.name]
        self.generation_ids = list(tokenizer(self.generation_prompt, add_special_tokens=False)["input_ids"])

    def body(self, messages: Messages) -> str:
        text = self.renderer.render(*chat(messages)).text
        assert text.endswith(self.generation_prompt)
        return text[: len(text) - len(self.generation_prompt)]

    def prompt(self, messages: Messages) -> Prompt:
        rendered = self.renderer.render(*chat(messages))
        assert rendered.text.endswith(self.generation_prompt)
        ids, prefix_len = self.prompt_tokens.encode(rendered.text, rendered.prefix_chars)
        body_len = len(ids) - len(self.generation_ids)
        assert ids[body_len:] == self.generation_ids  # the generation prompt's own tokens, from a token boundary
        return Prompt(ids, prefix_len, body_len)

    @cached_property
    def recorded(self) -> list[list[Prompt]]:
        return [[self.prompt(turn) for turn in turns] for turns in conversations()]

    def pairs(self) -> list[tuple[Prompt, Prompt]]:
        out = [pair for prompts in self.recorded for pair in pairwise(prompts)]
        assert len(out) == RECORDED_PAIRS
        return out

    def openers(self, messages: Messages) -> list[str | None]:
        """The token each message after the system prompt opens with: the first token after the
        prompt of the messages before it, less its generation prompt. TEXT for an ordinary token;
        None when that prompt is no prefix of the whole one (the message continues the turn before
        it) or cannot be rendered at all (Llama 3.1 refuses tools without a user message)."""
        full = self.renderer.render(*chat(messages)).text
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        token_at = {start: token for token, (start, _) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)}
        out: list[str | None] = []
        for count in range(1, len(messages)):
            try:
                body = self.body(messages[:count])
            except RenderError:
                out.append(None)
                continue
            token = self.tokenizer.convert_ids_to_tokens(token_at[len(body)]) if full.startswith(body) else None
            out.append(TEXT if token is not None and token not in self.prompt_tokens.boundaries else token)
        return out


@pytest.fixture(scope="module")
def family(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Family]:
    made: dict[str, Family] = {}

    def make(name: str) -> Family:
        if name not in made:
            target = save_family_tokenizer(SETUPS[name], tokenizer_dir, tmp_path_factory.mktemp(f"tok-{name}"))
            made[name] = Family(AutoTokenizer.from_pretrained(target), SETUPS[name].arch)
        return made[name]

    return make


# ---- the previous prompt's tokens are the head of the next one --------------------------------


@pytest.mark.parametrize("name", list(SETUPS))
def test_a_turn_starts_with_the_previous_turns_tokens_up_to_its_generation_prompt(family, name):
    fam = family(name)
    for before, after in fam.pairs():
        assert after.ids[: before.body_len] == before.body_ids
        assert after.prefix_len == before.prefix_len > 1000  # and one tool group throughout


@pytest.mark.parametrize("name", ["chatml", "chatml-native", "mistral"])
def test_the_whole_previous_prompt_is_a_token_prefix_of_the_next(family, name):
    """ChatML's generation prompt is also the head of the assistant turn that answers it (and
    Mistral has none), so every token of the previous prompt is reused."""
    for before, after in family(name).pairs():
        assert after.ids[: len(before.ids)] == before.ids


# Llama 3's pre-tokenizer split pattern (tokenizer.json of Llama 3.x).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def test_llama3_shape_retokenizes_the_last_token_of_its_generation_prompt(family):
    """Llama 3's generation prompt ends in "\\n\\n", and the test tokenizer (SmolLM2's vocabulary)
    pre-tokenizes with GPT-2's pattern, whose `\\s+(?!\\S)` takes whitespace at the end of a text
    whole ("\\n\\n": one token) but leaves the last whitespace character to the word after it
    otherwise ("\\n\\n{": "\\n", "\\n", "{"). So the previous prompt is the next one's head up to
    its last token only, and the answer generated after that token is recomputed. Llama 3's own
    pattern tries `\\s*[\\r\\n]+` first and takes "\\n\\n" whole either way: with the real tokenizer
    the whole prompt is a prefix, as for ChatML (whose generation prompt ends in one "\\n")."""
    fam = family("llama3")
    for before, after in fam.pairs():
        last = len(before.ids) - 1
        assert after.ids[:last] == before.ids[:last]
        assert fam.tokenizer.decode(before.ids[last:]) == "\n\n"
        assert fam.tokenizer.decode(after.ids[last : last + 2]) == "\n\n" != fam.tokenizer.decode(after.ids[last])

    def pieces(pre_tokenizer: Any, text: str) -> list[str]:
        return [piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)]

    smollm = fam.tokenizer.backend_tokenizer.pre_tokenizer
    assert pieces(smollm, "\n\n") == ["ĊĊ"] and pieces(smollm, '\n\n{"name"')[:2] == ["Ċ", "Ċ"]
    llama3 = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated")
    assert pieces(llama3, "\n\n") == ["\n\n"] and pieces(llama3, '\n\n{"name"')[0] == "\n\n"


# ---- the token each message opens with (where the engine may cut a chunk) ---------------------


def expected_opener(name: str, message: dict[str, Any], first_user: bool) -> str | None:
    if name.startswith("chatml"):
        return "<|im_start|>"
    if name == "llama3":  # the first user message's text follows the tools, in the same user turn
        return None if first_user else "<|start_header_id|>"
    if message["role"] == "assistant":  # Mistral: an answer is plain text after [/INST] or [/TOOL_RESULTS]
        return "[TOOL_CALLS]" if message.get("tool_calls") else TEXT
    return {"user": "[INST]", "tool": "[TOOL_RESULTS]"}[message["role"]]


@pytest.mark.parametrize("name", list(SETUPS))
def test_every_message_opens_with_the_familys_turn_marker(family, name):
    fam = family(name)
    for turns in conversations():
        messages = turns[-1]
        first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
        expected = [expected_opener(name, m, i == first_user) for i, m in enumerate(messages) if i]
        assert fam.openers(messages) == expected
    if name == "llama3":  # the tool group's cut is where the first user message's text starts
        rendered = fam.renderer.render(*chat(messages))
        assert rendered.text[rendered.prefix_chars :].startswith(messages[first_user]["content"].strip())


PARALLEL: Messages = [{"role": "system", "content": "You are an airline agent."},
            {"role": "user", "content": "Cancel 4WQ150 and tell me its details."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{n}", "type": "function",
                 "function": {"name": n, "arguments": '{"reservation_id": "4WQ150"}'}}
                for n in ("get_reservation_details", "cancel_reservation")]},
            {"role": "tool", "tool_call_id": "call_get_reservation_details", "content": '{"status": "active"}'},
            {"role": "tool", "tool_call_id": "call_cancel_reservation", "content": '{"status": "cancelled"}'}]


@pytest.mark.parametrize("name, result_openers", [
    ("chatml", ["<|im_start|>", None]), ("chatml-native", ["<|im_start|>", None]),
    ("llama3", ["<|start_header_id|>"] * 2), ("mistral", ["[TOOL_RESULTS]"] * 2),
])
def test_the_results_of_parallel_calls_and_the_turn_that_asks_for_them(family, name, result_openers):
    """ChatML writes all results of one call turn into one user turn, so the second result opens
    with no marker (a prompt cut between two results would not be a prefix; clients send them
    together). Llama 3.1's template takes one call per assistant turn, so the renderer writes the
    calls of every turn as text once any turn has two; it writes them as the template does, so the
    turns before keep their tokens."""
    fam = family(name)
    assert fam.openers(PARALLEL)[-2:] == result_openers
    before, after = fam.prompt(PARALLEL[:2]), fam.prompt(PARALLEL)
    assert after.ids[: before.body_len] == before.body_ids
    single = {**PARALLEL[2], "tool_calls": PARALLEL[2]["tool_calls"][:1]}
    earlier = [*PARALLEL[:2], single, PARALLEL[3], {"role": "user", "content": "And the other one?"}]
    assert fam.body(earlier + PARALLEL[2:]).startswith(fam.body(earlier))


# ---- a template that re-renders earlier turns --------------------------------------------------


def test_mistral_models_own_template_moves_the_tools_to_the_last_user_message(family):
    """Why the mistral family renders with its own template: Mistral's template writes the tools
    (and the system prompt) just before the *last* user message. A turn that adds a user message
    therefore differs from the previous turn from exactly where that turn's [AVAILABLE_TOOLS]
    stood, and no tool group sits at the head. Turns adding only calls and results keep it."""
    fam = family("mistral")
    tok = fam.tokenizer
    assert fam.renderer.template == fam.renderer.family.tools_template != tok.chat_template
    tools_id = tok.convert_tokens_to_ids("[AVAILABLE_TOOLS]")

    def ids(messages: Messages) -> list[int]:
        text = tok.apply_chat_template(messages, tools=AIRLINE_TOOLS, tokenize=False)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    moved = kept = 0
    for turns in conversations():
        prompts = [ids(turn) for turn in turns]
        for (before, after), (old, new) in zip(pairwise(turns), pairwise(prompts), strict=True):
            if any(m["role"] == "user" for m in after[len(before):]):
                common = next(i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b)
                assert common == old.index(tools_id) > 0
                moved += 1
            else:
                assert new[: len(old)] == old
                kept += 1
    assert moved and kept and moved + kept == RECORDED_PAIRS
