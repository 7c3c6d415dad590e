"""What the bench sends: tool groups cut from a tool catalog, unique questions, request bodies.

Every group's system message carries the run id, so a group is new to the server at the start of
every run (a long-lived server or its disk tier cannot turn a planned miss into a hit).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapters.base import ToolSpec
from adapters.hermes import HermesFamily
from gateway.bench.data import MERCHANT_TOOLS

DEFAULT_TOOLS_FILE = MERCHANT_TOOLS

_QUESTIONS = (
    "What was our total GMV last week, broken down by channel?",
    "How many refunds did we process in March, and what was their total value?",
    "Which five products brought in the most revenue yesterday?",
    "Is the blue running shoe in size 42 still in stock at the Berlin warehouse?",
    "Show me the orders from customer C-1042 placed this month.",
    "What is the average order value on the app compared with the website?",
    "Which marketing campaign had the best conversion rate in Q2?",
    "How many new customers signed up during the spring sale?",
    "List the suppliers whose deliveries were late more than twice this quarter.",
    "What share of our orders shipped within 24 hours last month?",
    "Which products have fewer than ten units left in stock?",
    "How did the weekend flash sale affect margins?",
    "Summarise the customer reviews for the espresso machine.",
    "What is the churn rate of subscription customers since January?",
    "Which region had the highest return rate last quarter?",
    "Forecast next month's demand for winter jackets.",
)
# Appended to the question where output tokens are measured (the concurrent scenario): the model
# talks until max_tokens instead of stopping after a sentence, without `ignore_eos`.
TALK = " Explain your reasoning step by step, in detail, before you answer."


class WorkloadError(ValueError):
    """The tool catalog cannot be used; the message says why."""


def load_tools(path: Path) -> list[dict[str, Any]]:
    """A JSON list of OpenAI-format tools (or an object with a `tools` list)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise WorkloadError(f"tools file not found: {path} (pass --tools-file FILE)") from None
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"tools file {path} is not valid JSON: {exc}") from None
    tools = data.get("tools") if isinstance(data, dict) else data
    if not isinstance(tools, list) or not all(isinstance(t, dict) and "function" in t for t in tools):
        raise WorkloadError(f"tools file {path} must hold a list of OpenAI tools ({{'type': 'function', ...}})")
    return tools


@dataclass(frozen=True, slots=True)
class ToolGroup:
    """A system message plus a slice of the catalog: the prefix the server caches."""

    label: str
    system: str
    tools: tuple[dict[str, Any], ...]
    offset: int  # index of the first tool in the catalog

    @property
    def num_tools(self) -> int:
        return len(self.tools)


class Workload:
    """Builds groups and request bodies for one run; questions never repeat within the run."""

    def __init__(self, catalog: list[dict[str, Any]], run_id: str, *, model: str | None, max_tokens: int,
                 tool_choice: str, tools_in_system: bool) -> None:
        self.catalog = catalog
        self.run_id = run_id
        self.model = model
        self.max_tokens = max_tokens
        self.tool_choice = tool_choice
        self.tools_in_system = tools_in_system
        self._counter = itertools.count(1)

    def group(self, label: str, num_tools: int, offset: int = 0) -> ToolGroup:
        tools = self.catalog[offset : offset + num_tools]
        if len(tools) < num_tools:
            raise WorkloadError(f"group {label} needs tools {offset}..{offset + num_tools - 1}; "
                                f"the catalog has {len(self.catalog)}")
        system = (f"You are the back-office assistant of an online merchant (bench run {self.run_id}, "
                  f"group {label}). Answer briefly; call a tool when it helps.")
        return ToolGroup(label, system, tuple(tools), offset)

    def question(self, *, talk: bool = False) -> str:
        number = next(self._counter)
        question = f"{_QUESTIONS[number % len(_QUESTIONS)]} (ticket {self.run_id}-{number:04d})"
        return question + TALK if talk else question

    def body(self, group: ToolGroup, max_tokens: int | None = None, *, talk: bool = False) -> dict[str, Any]:
        """A streaming chat request on `group` with a question never sent before in this run; `talk`
        asks for a long answer (for output tokens/s)."""
        return self.chat_body(group, [{"role": "user", "content": self.question(talk=talk)}], max_tokens)

    def chat_body(self, group: ToolGroup, messages: list[dict[str, str]],
                  max_tokens: int | None = None) -> dict[str, Any]:
        """A streaming chat request: `group`'s system message and tools, then `messages`."""
        system = group.system
        body: dict[str, Any] = {
            "messages": [{"role": "system", "content": system}, *messages],
            "max_tokens": max_tokens or self.max_tokens, "temperature": 0, "seed": 0,
            "stream": True, "stream_options": {"include_usage": True},
        }
        if self.tools_in_system:  # for servers whose chat template drops `tools`
            body["messages"][0]["content"] = system + "\n\n" + tools_block(group.tools)
        elif group.tools:
            body["tools"] = list(group.tools)
            body["tool_choice"] = self.tool_choice
        if self.model:
            body["model"] = self.model
        return body


def tools_block(tools: tuple[dict[str, Any], ...]) -> str:
    """The tools as toolkv's ChatML adapter writes them into the system message."""
    specs = tuple(ToolSpec(t["function"]["name"], t["function"].get("description"),
                           t["function"].get("parameters")) for t in tools)
    return HermesFamily().tools_block(specs)
