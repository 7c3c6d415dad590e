"""`toolkv parity`: tool-calling quality through the cache against the same requests without it.

Runs a tool-calling set at temperature 0 against a running server, each query twice: through the
cache, and with `X-Toolkv-Cache: bypass` (a plain full prefill). Reports how many outputs are
identical (content, calls and their arguments, finish reason; call ids are random and not
compared) — the goal is all of them — and the tool-selection accuracy of each path: the first
call's name against the tool the query needs. Exits 1 when any output differs.

The built-in set is 20 queries for tau-bench's 16 retail tools; `--queries FILE` takes JSON lines
`{"query": "...", "expected_tool": "..."}` for another tool file.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_TOOLS_FILE = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "retail_16_tools.json"
DEFAULT_SYSTEM = ("You are a customer service agent for an online retail store. Help the user with "
                  "their orders, returns, exchanges and account, using the tools when they are needed.")
BYPASS_HEADERS = {"X-Toolkv-Cache": "bypass"}


@dataclass(frozen=True, slots=True)
class Query:
    query: str
    expected_tool: str


RETAIL_QUERIES = tuple(Query(q, t) for q, t in (
    ("My email is noah.brown7@example.com, can you find my account?", "find_user_id_by_email"),
    ("I'm Yusuf Rossi and my zip code is 19122. Please look up my user id.", "find_user_id_by_name_zip"),
    ("What's the status of my order #W2378156?", "get_order_details"),
    ("Show me the profile and the orders of user yusuf_rossi_9620.", "get_user_details"),
    ("What kinds of products do you sell?", "list_all_product_types"),
    ("What options and prices are available for product 6086499569?", "get_product_details"),
    ("Please cancel my pending order #W5918442, I ordered it by mistake.", "cancel_pending_order"),
    ("I want to return item 4068787148 from my delivered order #W7273336, refund to credit_card_9513926.",
     "return_delivered_order_items"),
    ("Exchange item 2768401027 in delivered order #W6390527 for item 7533802601, paying with paypal_4238515.",
     "exchange_delivered_order_items"),
    ("Ship pending order #W4860251 to 445 Maple Drive, Suite 394, Fort Worth, TX, USA 76165 instead.",
     "modify_pending_order_address"),
    ("In pending order #W1092119 swap item 8470360507 for item 5339029584, using gift_card_7245904.",
     "modify_pending_order_items"),
    ("Please charge paypal_3024827 instead of my card for pending order #W3823200.",
     "modify_pending_order_payment"),
    ("Change the default address of user mei_kovacs_8020 to 317 Elm Street, Apt 2, Denver, CO, USA 80202.",
     "modify_user_address"),
    ("What is 149.99 * 3 - 20?", "calculate"),
    ("I want to talk to a real person, not a bot.", "transfer_to_human_agents"),
    ("Find the user whose email is sofia.rossi2645@example.com.", "find_user_id_by_email"),
    ("Has my order #W9711842 shipped yet?", "get_order_details"),
    ("Which variants of product 9523456873 are in stock?", "get_product_details"),
    ("Cancel order #W8665881, I no longer need it.", "cancel_pending_order"),
    ("Add up 45.50 + 19.99 + 7.25 for me.", "calculate"),
))


@dataclass(frozen=True, slots=True)
class Answer:
    content: str | None
    calls: tuple[tuple[str, str], ...]  # (name, arguments JSON text)
    finish_reason: str
    cached_tokens: int

    @classmethod
    def of(cls, response: dict[str, Any]) -> Answer:
        choice = response["choices"][0]
        message = choice["message"]
        calls = tuple((c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ())
        details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
        return cls(message.get("content"), calls, choice["finish_reason"], int(details.get("cached_tokens") or 0))

    @property
    def output(self) -> tuple[Any, ...]:
        """What a user sees; call ids are random per response, so they are left out."""
        return (self.content, self.calls, self.finish_reason)

    @property
    def first_tool(self) -> str | None:
        return self.calls[0][0] if self.calls else None


@dataclass(slots=True)
class Report:
    model: str
    tool_choice: str = "auto"
    num_queries: int = 0
    identical: int = 0
    correct_cached: int = 0
    correct_bypass: int = 0
    cache_hits: int = 0
    differing: list[dict[str, Any]] = field(default_factory=list)

    def add(self, query: Query, cached: Answer, bypass: Answer) -> None:
        self.num_queries += 1
        self.identical += cached.output == bypass.output
        self.correct_cached += cached.first_tool == query.expected_tool
        self.correct_bypass += bypass.first_tool == query.expected_tool
        self.cache_hits += cached.cached_tokens > 0
        if cached.output != bypass.output:
            self.differing.append({"query": query.query, "cached": cached.output, "bypass": bypass.output})

    def lines(self) -> list[str]:
        n = self.num_queries
        accuracy = f"cache {_share(self.correct_cached, n)}, bypass {_share(self.correct_bypass, n)}"
        summary = [f"model {self.model}, {n} queries at temperature 0, tool_choice {self.tool_choice}",
                   f"identical outputs (cache vs bypass): {self.identical}/{n}",
                   f"tool-selection accuracy: {accuracy}",
                   f"served from the cache: {self.cache_hits}/{n} (cached_tokens > 0)"]
        return summary + [f"DIFFERS: {d['query']!r}\n  cache:  {d['cached']}\n  bypass: {d['bypass']}"
                          for d in self.differing]


class ParityClient:
    """Non-streamed chat completions against an OpenAI-compatible server (stdlib HTTP only)."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s = timeout_s

    def model(self) -> str:
        return str(self._call("GET", "/models", None, {})["data"][0]["id"])

    def chat(self, body: dict[str, Any], bypass: bool) -> Answer:
        return Answer.of(self._call("POST", "/chat/completions", body, BYPASS_HEADERS if bypass else {}))

    def _call(self, method: str, path: str, body: dict[str, Any] | None, headers: dict[str, str]) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base_url + path, data=data, method=method,
                                         headers={**self.headers, **headers})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
            return json.loads(resp.read())


def run_parity(client: ParityClient, model: str, tools: list[dict[str, Any]], system: str,
               queries: Iterable[Query], max_tokens: int, tool_choice: str = "auto") -> Report:
    report = Report(model, tool_choice)
    for query in queries:
        body = {"model": model, "messages": [{"role": "system", "content": system},
                                             {"role": "user", "content": query.query}],
                "tools": tools, "tool_choice": tool_choice, "temperature": 0, "max_tokens": max_tokens}
        report.add(query, client.chat(body, bypass=False), client.chat(body, bypass=True))
    return report


def load_queries(path: str | None, tool_names: set[str]) -> list[Query]:
    """The queries (the built-in set when `path` is None); each must expect a tool in the file."""
    if path is None:
        queries = list(RETAIL_QUERIES)
    else:
        lines = Path(path).read_text().splitlines()
        queries = [Query(**json.loads(line)) for line in lines if line.strip()]
    missing = sorted({q.expected_tool for q in queries} - tool_names)
    if missing:
        raise ValueError(f"expected tools not in the tools file: {', '.join(missing)} "
                         "(pass --queries for another tool file)")
    return queries


def register(sub: Any) -> None:
    """Add the `parity` subcommand to the CLI's subparsers."""
    cmd = sub.add_parser("parity", help="tool-calling outputs through the cache vs the bypass, at temperature 0")
    cmd.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL")
    cmd.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' when the server needs one")
    cmd.add_argument("--model", help="the model id to send (default: the server's first model)")
    cmd.add_argument("--tools", default=str(DEFAULT_TOOLS_FILE), help="a JSON list of OpenAI tools")
    cmd.add_argument("--queries", help='JSON lines {"query", "expected_tool"} (default: the built-in retail set)')
    cmd.add_argument("--system", default=DEFAULT_SYSTEM, help="the system prompt")
    cmd.add_argument("--tool-choice", choices=("auto", "required"), default="auto",
                     help="'required' forces a call, so accuracy measures the choice of tool alone")
    cmd.add_argument("--max-tokens", type=int, default=64)
    cmd.add_argument("--limit", type=int, help="run only the first N queries")
    cmd.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    cmd.add_argument("--json", action="store_true", help="print the report as one JSON document")
    cmd.set_defaults(func=_parity)


def _parity(args: argparse.Namespace) -> int:
    try:
        tools = json.loads(Path(args.tools).read_text())
        queries = load_queries(args.queries, {t["function"]["name"] for t in tools})[: args.limit]
        client = ParityClient(args.base_url, args.api_key, args.timeout)
        report = run_parity(client, args.model or client.model(), tools, args.system, queries, args.max_tokens,
                            args.tool_choice)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # urllib's errors are OSErrors
        print(f"toolkv parity: {_describe(exc)}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(report), indent=2) if args.json else "\n".join(report.lines()))
    return 0 if report.identical == report.num_queries else 1


def _describe(exc: Exception) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"the server answered {exc.code}: {exc.read().decode(errors='replace')[:500]}"
    return f"{type(exc).__name__}: {exc}"


def _share(count: int, total: int) -> str:
    return f"{count}/{total} ({100 * count / total:.0f}%)" if total else "0/0"
