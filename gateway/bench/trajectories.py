"""What the agent scenario sends: recorded tau-bench conversations, one streaming request per turn.

A line of the trajectory file is one step of an agent: `{task_id, trial, reward, turn_index,
messages}`, where `messages` is everything the agent sent at that step (system, user, assistant
messages with tool calls, tool results). A conversation is the lines of one (task_id, trial) in
turn order; each turn's messages extend the previous turn's.

The run id opens the system message, so a conversation is new to the server at the start of
every run (as every scenario's groups are); everything after it is the recorded text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapters.base import ChatMessage, ToolCallIn, ToolGroup, ToolSpec
from adapters.hermes import HermesFamily
from gateway.bench.data import AIRLINE_TOOLS, AIRLINE_TRAJECTORIES
from gateway.bench.workload import Workload, WorkloadError, load_tools

DEFAULT_TRAJECTORIES_FILE = AIRLINE_TRAJECTORIES
DEFAULT_TRAJECTORY_TOOLS_FILE = AIRLINE_TOOLS


@dataclass(frozen=True, slots=True)
class Turn:
    index: int  # the file's turn_index
    messages: tuple[dict[str, Any], ...]


@dataclass(frozen=True, slots=True)
class Conversation:
    task_id: int
    trial: int
    turns: tuple[Turn, ...]

    @property
    def label(self) -> str:
        return f"task {self.task_id}.{self.trial}"


@dataclass(frozen=True, slots=True)
class Trajectories:
    conversations: tuple[Conversation, ...]
    tools: tuple[dict[str, Any], ...]

    @property
    def num_turns(self) -> int:
        return sum(len(c.turns) for c in self.conversations)


def load_trajectories(path: Path, tools_path: Path, count: int) -> Trajectories:
    """The first `count` conversations in (task_id, trial) order, with the domain's tools."""
    by_key: dict[tuple[int, int], list[Turn]] = {}
    for key, turn in _read_turns(path):
        by_key.setdefault(key, []).append(turn)
    if count > len(by_key):
        raise WorkloadError(f"--conversations {count}: {path} holds {len(by_key)} conversations")
    conversations = tuple(Conversation(task, trial, tuple(sorted(by_key[task, trial], key=lambda t: t.index)))
                          for task, trial in sorted(by_key)[:count])
    return Trajectories(conversations, tuple(load_tools(tools_path)))


def _read_turns(path: Path) -> list[tuple[tuple[int, int], Turn]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise WorkloadError(f"trajectory file not found: {path} (pass --trajectories FILE)") from None
    turns = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            messages = row["messages"]
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
                raise TypeError("messages must be a list of chat messages")
            turns.append(((int(row["task_id"]), int(row["trial"])), Turn(int(row["turn_index"]), tuple(messages))))
        except (ValueError, KeyError, TypeError) as exc:
            raise WorkloadError(f"{path} line {number} is not a trajectory turn "
                                f"({{task_id, trial, turn_index, messages}}): {exc}") from None
    return turns


def turn_body(turn: Turn, tools: tuple[dict[str, Any], ...], workload: Workload, max_tokens: int) -> dict[str, Any]:
    """A streaming request replaying `turn`: its messages with the tools in `tools`, or written into
    the system message with `--tools-in-system` (for servers whose chat template drops `tools`)."""
    messages = [dict(m) for m in turn.messages]
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"(bench run {workload.run_id})\n\n{messages[0].get('content') or ''}"
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "seed": 0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if workload.tools_in_system:
        body["messages"] = plain_messages(messages, tools)
    else:
        body.update(messages=messages, tools=list(tools), tool_choice=workload.tool_choice)
    if workload.model:
        body["model"] = workload.model
    return body


def plain_messages(messages: list[dict[str, Any]], tools: tuple[dict[str, Any], ...]) -> list[dict[str, str]]:
    """The conversation as plain system, user and assistant text, written as toolkv writes it for a
    chat template that drops tools (ChatML, Hermes calls): the tools in canonical order after the
    system text, calls as `<tool_call>` text, each run of tool results as one user turn of
    `<tool_response>` blocks. A plain ChatML server then reads the text toolkv renders from `tools`."""
    family = HermesFamily()
    out: list[dict[str, str]] = []
    if tools and (not messages or messages[0]["role"] != "system"):
        out.append({"role": "system", "content": _tools_block(tools)})
    after_tool = False  # the last turn written holds tool results: the next result joins it
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "tool":
            text = family.tool_result_text(ChatMessage(role="tool", content=content))
            if after_tool:
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": family.tool_result_role, "content": text})
        elif m["role"] == "assistant":
            out.append({"role": "assistant", "content": family.assistant_text(_assistant(m))})
        elif m["role"] == "system" and not out:
            out.append({"role": "system", "content": "\n\n".join(p for p in (content, _tools_block(tools)) if p)})
        else:
            out.append({"role": m["role"], "content": content})
        after_tool = m["role"] == "tool"
    return out


def _assistant(message: dict[str, Any]) -> ChatMessage:
    calls = tuple(ToolCallIn(id=c.get("id", ""), name=c["function"]["name"], arguments=_arguments(c["function"]))
                  for c in message.get("tool_calls") or ())
    return ChatMessage(role="assistant", content=message.get("content"), tool_calls=calls)


def _arguments(function: dict[str, Any]) -> str:
    arguments = function.get("arguments", "{}")
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _tools_block(tools: tuple[dict[str, Any], ...]) -> str:
    specs = [ToolSpec(t["function"]["name"], t["function"].get("description"), t["function"].get("parameters"))
             for t in tools]
    return HermesFamily().tools_block(ToolGroup.of(None, specs).tools) if specs else ""
