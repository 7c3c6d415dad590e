"""The agent scenario end to end: real tau-bench airline conversations replayed turn by turn through
`toolkv bench` against a tiny model served on 127.0.0.1 (context 8,192: task 0 grows to ~7,800
tokens). One row per turn, token counts that add up, the plot; `--tools-in-system` sends the text
toolkv renders from `tools`. Whether cached tokens grow across turns is the engine's business
(conversation reuse), not asserted here."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from transformers import AutoTokenizer

from adapters.hermes import HermesFamily
from adapters.render import PromptRenderer
from gateway.bench.agent_report import agent_stats
from gateway.bench.client import Sample
from gateway.bench.lab.targets import targets
from gateway.bench.trajectories import (
    DEFAULT_TRAJECTORIES_FILE,
    DEFAULT_TRAJECTORY_TOOLS_FILE,
    load_trajectories,
    turn_body,
)
from gateway.bench.workload import Workload
from gateway.cli.main import main
from gateway.protocol.chat import ChatCompletionRequest
from gateway.settings import load_settings
from tests.support.server import LiveServer, serve

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def recorded_turns(task_id: int, trial: int) -> list[int]:
    """The turn indices of one conversation, read from the file without the bench's loader."""
    with DEFAULT_TRAJECTORIES_FILE.open() as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    return sorted(r["turn_index"] for r in rows if (r["task_id"], r["trial"]) == (task_id, trial))


def bench(base_url: str, out: Path, *options: str) -> tuple[dict[str, Any], str]:
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setenv("COLUMNS", "200")  # rich sizes its tables to the terminal; keep the rows on one line
        code = main(["bench", "--base-url", base_url, "--scenario", "agent", "--out", str(out), *options])
    assert code == 0
    return json.loads((out / "bench.json").read_text()), printed.getvalue()


@pytest.fixture(scope="module")
def live_8k(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama", context=8192)),
                                        "served_model_name": "tiny-llama-8k",
                                        "cache_dir": str(tmp_path_factory.mktemp("cache-8k"))}, environ={})
    with serve(settings) as server:
        yield server


@pytest.fixture(scope="module")
def run(live_8k: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, str]:
    out = tmp_path_factory.mktemp("bench-agent")
    data, printed = bench(live_8k.base_url, out)
    return data, out, printed


def test_one_row_per_recorded_turn_of_task_0(run):
    agent = run[0]["scenarios"]["agent"]
    assert agent["skipped"] is None and agent["errors"] == 0 and agent["notes"] == []
    assert [r["turn"] for r in agent["turns"]] == recorded_turns(0, 0)
    assert {r["conversation"] for r in agent["turns"]} == {"task 0.0"}
    assert [r["first_turn"] for r in agent["turns"]] == [True] + [False] * (len(agent["turns"]) - 1)
    assert all(r["ttft_ms"] > 0 for r in agent["turns"])
    assert all(s["completion_tokens"] <= 16 for s in agent["samples"])  # --agent-max-tokens' default


def test_token_counts_add_up_turn_by_turn(run):
    rows = run[0]["scenarios"]["agent"]["turns"]
    prompts = [r["prompt_tokens"] for r in rows]
    assert all(later > earlier for earlier, later in pairwise(prompts))
    for r in rows:
        assert r["cached_tokens"] + r["computed_tokens"] == r["prompt_tokens"]
    assert rows[0]["new_tokens"] is None
    for before, r in pairwise(rows):
        assert r["new_tokens"] == r["prompt_tokens"] - before["prompt_tokens"]
        assert r["computed_minus_new"] == r["computed_tokens"] - r["new_tokens"]


def test_summary_covers_the_turns_after_the_first(run):
    data = run[0]
    agent = data["scenarios"]["agent"]
    later = agent["turns"][1:]
    summary = agent["summary"]
    assert agent["new_tokens_from"] == "prompt_delta"
    assert summary["turns"] == len(later)
    assert summary["computed_tokens_p50"] == sorted(r["computed_tokens"] for r in later)[len(later) // 2]
    assert summary["computed_minus_new_max"] == max(r["computed_minus_new"] for r in later)
    assert 0 < summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p95"]
    assert targets(data)["agent_computes_only_new_messages"] == (summary["computed_minus_new_max"] <= 16)


def test_table_prints_every_turn(run):
    data, _, printed = run
    assert "agent: tau-bench conversations replayed turn by turn" in printed
    for r in data["scenarios"]["agent"]["turns"]:
        assert f" {r['turn']} " in printed and f"{r['prompt_tokens']:,}" in printed
    assert f"agent, {len(data['scenarios']['agent']['turns']) - 1} turns after each conversation's first" in printed


def test_agent_plot_is_a_png(run):
    path = run[1] / "agent.png"
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.verify()
        assert image.size[0] > 600 and image.size[1] > 600


def test_tools_in_system_adds_the_same_tokens_per_turn(live_8k, run, tmp_path):
    """Written into the system message, the tools and tool turns tokenize as toolkv renders them from
    `tools`: every turn adds the same tokens (the run id in the system message differs between runs,
    so whole prompts may differ by up to five tokens). Two conversations: each starts its own deltas."""
    data, _ = bench(live_8k.base_url, tmp_path, "--tools-in-system", "--conversations", "2",
                    "--agent-max-tokens", "2")
    rows = data["scenarios"]["agent"]["turns"]
    first = run[0]["scenarios"]["agent"]["turns"]
    assert data["options"]["tools_in_system"] is True and data["scenarios"]["agent"]["errors"] == 0
    assert [r["conversation"] for r in rows] == ["task 0.0"] * len(first) + ["task 2.0"] * len(recorded_turns(2, 0))
    assert [r["new_tokens"] for r in rows[:len(first)]] == [r["new_tokens"] for r in first]
    # the runs' ids (8 random hex digits) tokenize to 2-7 tokens (measured over 2,000 ids)
    assert abs(rows[0]["prompt_tokens"] - first[0]["prompt_tokens"]) <= 5
    assert [r["first_turn"] for r in rows].count(True) == 2 and rows[len(first)]["new_tokens"] is None
    assert data["scenarios"]["agent"]["summary"]["turns"] == len(rows) - 2


def test_a_turn_beyond_the_context_skips_the_rest_of_its_conversation(live, tmp_path):
    data, printed = bench(live.base_url, tmp_path, "--agent-max-tokens", "2")  # context 4,096 < task 0's turns
    agent = data["scenarios"]["agent"]
    assert agent["turns"] == [] and agent["summary"]["turns"] == 0
    assert "turn 6 and the 7 after it skipped, beyond the model's context" in agent["notes"][0]
    assert targets(data)["agent_computes_only_new_messages"] is None
    assert "beyond the model's context" in printed


def rendered_turns(tokenizer_dir: Path, *, tools_in_system: bool) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Every recorded turn's body, and the text toolkv renders from it with SmolLM2's template (which
    drops `tools`): (turn label, text, body)."""
    trajectories = load_trajectories(DEFAULT_TRAJECTORIES_FILE, DEFAULT_TRAJECTORY_TOOLS_FILE, 22)
    renderer = PromptRenderer(AutoTokenizer.from_pretrained(tokenizer_dir), HermesFamily())
    assert not renderer.native_tools
    workload = Workload([], "run0", model=None, max_tokens=16, tool_choice="none", tools_in_system=tools_in_system)
    for conversation in trajectories.conversations:
        for turn in conversation.turns:
            body = turn_body(turn, trajectories.tools, workload, 16)
            request = ChatCompletionRequest.model_validate(body)
            text = renderer.render([m.to_chat() for m in request.messages], [t.to_spec() for t in request.tools or ()])
            yield f"{conversation.label} turn {turn.index}", text.text, body


def test_plain_messages_render_as_toolkv_renders_tools(tokenizer_dir):
    """`--tools-in-system` is for servers whose template drops `tools`: its messages must render to
    the text toolkv renders from `tools` for such a template (SmolLM2's), on every recorded turn."""
    with_tools = list(rendered_turns(tokenizer_dir, tools_in_system=False))
    in_system = list(rendered_turns(tokenizer_dir, tools_in_system=True))
    assert len(with_tools) == len(in_system) == 150
    for (label, text, _), (_, plain, _) in zip(with_tools, in_system, strict=True):
        assert text == plain, label


def test_llama_cpp_chatml_reads_the_text_toolkv_renders(tokenizer_dir):
    """The peer the README compares with: llama-cpp-python's `chatml` format, given the
    `--tools-in-system` messages, writes the prompt toolkv renders from `tools`."""
    chat_format = pytest.importorskip("llama_cpp.llama_chat_format")
    with_tools = rendered_turns(tokenizer_dir, tools_in_system=False)
    in_system = rendered_turns(tokenizer_dir, tools_in_system=True)
    for (label, text, _), (_, _, body) in zip(with_tools, in_system, strict=True):
        assert chat_format.format_chatml(body["messages"]).prompt == text, label


def sample(group: str, turn: int, prompt: int | None, cached: int | None, error: str | None = None) -> Sample:
    return Sample("agent", group, 14, 0, "any", False, 0.0, ttft_s=0.1 * turn, prompt_tokens=prompt,
                  cached_tokens=cached, error=error, tags={"task_id": 0, "trial": 0, "turn": turn})


def test_stats_skip_first_turns_and_failed_turns():
    out = agent_stats([sample("a", 1, 1000, 0), sample("a", 2, 1100, 996), sample("b", 1, 900, 800),
                       sample("a", 3, None, None, error="HTTP 500: boom"), sample("a", 4, 1300, 1000),
                       sample("b", 2, 950, 896)])
    rows = out["turns"]
    assert [r["new_tokens"] for r in rows] == [None, 100, None, None, None, 50]  # a turn after a failure: unknown
    assert [r["computed_minus_new"] for r in rows] == [None, 4, None, None, None, 4]
    assert out["errors"] == 1
    summary = out["summary"]
    assert summary["turns"] == 3  # a2, a4, b2
    assert summary["computed_tokens_p50"] == 104 and summary["computed_minus_new_max"] == 4
    assert summary["ttft_ms"]["p50"] == 200.0
    assert _agent_target(out) is True
    assert _agent_target({"skipped": "why", **out}) is None


def test_stats_of_a_server_without_usage():
    out = agent_stats([sample("a", 1, None, None), sample("a", 2, None, None)])
    assert [r["computed_tokens"] for r in out["turns"]] == [None, None]
    assert out["summary"]["computed_tokens_p50"] is None and out["summary"]["ttft_ms"]["p50"] == 200.0
    assert _agent_target(out) is None


def test_a_missing_trajectory_file_is_a_one_line_error(tmp_path, capsys):
    code = main(["bench", "--base-url", "http://127.0.0.1:9", "--scenario", "agent", "--out", str(tmp_path),
                 "--trajectories", str(tmp_path / "nope.jsonl")])
    assert code == 2
    assert "trajectory file not found" in capsys.readouterr().err


def test_more_conversations_than_the_file_holds_is_an_error(tmp_path, capsys):
    code = main(["bench", "--base-url", "http://127.0.0.1:9", "--scenario", "agent", "--out", str(tmp_path),
                 "--conversations", "1000"])
    assert code == 2
    assert "--conversations 1000" in capsys.readouterr().err


def _agent_target(agent: dict[str, Any]) -> bool | None:
    return targets({"scenarios": {"agent": agent}})["agent_computes_only_new_messages"]
