"""`toolkv parity`: tool-calling quality through the cache against the same requests without it.

Runs a tool-calling set at temperature 0 against a running server, each query twice: through the
cache, and with `X-Toolkv-Cache: bypass` (a plain full prefill). Reports how many outputs are
identical (content, calls and their arguments, finish reason; call ids are random and not
compared) — the goal is all of them — and the tool-selection accuracy of each path: the first
call's name against the tool the query needs. Exits 1 when any output differs.

The built-in set is 20 queries for tau-bench's 16 retail tools; `--queries FILE` takes JSON lines
`{"query": "...", "expected_tool": "...", "response_format": {...}}` (the last optional) for another
tool file. Constrained decoding is compared too: `--tool-choice required` forces a call, `named`
names each query's expected tool, and `--response-format` sends the structured-output rows of the
bench (gateway/bench/bfcl.py: json_schema and json_object) with the tools in the prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gateway.bench.bfcl import RETAIL_QUESTIONS, RETAIL_SYSTEM, SCHEMA_ROWS, WORKLOADS

DEFAULT_TOOLS_FILE = WORKLOADS / "retail_16_tools.json"
DEFAULT_SYSTEM = RETAIL_SYSTEM
BYPASS_HEADERS = {"X-Toolkv-Cache": "bypass"}
TOOL_CHOICES = ("auto", "none", "required", "named")


@dataclass(frozen=True, slots=True)
class Query:
    query: str
    expected_tool: str | None = None  # None: a structured-output query, no tool expected
    response_format: dict[str, Any] | None = None


RETAIL_QUERIES = tuple(Query(q, t) for q, t in RETAIL_QUESTIONS)
STRUCTURED_QUERIES = tuple(Query(row.question, response_format=row.response_format) for row in SCHEMA_ROWS)


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
    response_format: bool = False  # the queries carry a response_format (structured output)
    num_queries: int = 0
    with_tool: int = 0  # queries that expect a tool (the accuracies' denominator)
    identical: int = 0
    correct_cached: int = 0
    correct_bypass: int = 0
    cache_hits: int = 0
    differing: list[dict[str, Any]] = field(default_factory=list)

    def add(self, query: Query, cached: Answer, bypass: Answer) -> None:
        self.num_queries += 1
        self.identical += cached.output == bypass.output
        self.with_tool += query.expected_tool is not None
        self.correct_cached += query.expected_tool is not None and cached.first_tool == query.expected_tool
        self.correct_bypass += query.expected_tool is not None and bypass.first_tool == query.expected_tool
        self.cache_hits += cached.cached_tokens > 0
        if cached.output != bypass.output:
            self.differing.append({"query": query.query, "cached": cached.output, "bypass": bypass.output})

    def lines(self) -> list[str]:
        n, m = self.num_queries, self.with_tool
        accuracy = f"cache {_share(self.correct_cached, m)}, bypass {_share(self.correct_bypass, m)}"
        structured = ", with response_format" if self.response_format else ""
        summary = [f"model {self.model}, {n} queries at temperature 0, tool_choice {self.tool_choice}{structured}",
                   f"identical outputs (cache vs bypass): {self.identical}/{n}",
                   f"tool-selection accuracy: {accuracy}" if m else "tool-selection accuracy: no tool expected",
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
               queries: Iterable[Query], max_tokens: int, tool_choice: str = "auto",
               progress: Callable[[str], None] | None = None) -> Report:
    """`progress` gets a line per query as it finishes (its index, whether the two outputs match,
    each path's time): a CPU server's first query can take minutes while it compiles the group."""
    queries = list(queries)
    report = Report(model, tool_choice, response_format=any(q.response_format for q in queries))
    for index, query in enumerate(queries, 1):
        body = request_body(model, tools, system, query, max_tokens, tool_choice)
        (cached, cached_s), (bypass, bypass_s) = (_timed(client, body, False), _timed(client, body, True))
        report.add(query, cached, bypass)
        if progress is not None:
            progress(_case_line(f"[{index}/{len(queries)}]", query, cached, bypass, cached_s, bypass_s))
    return report


def _timed(client: ParityClient, body: dict[str, Any], bypass: bool) -> tuple[Answer, float]:
    started = time.perf_counter()
    answer = client.chat(body, bypass=bypass)
    return answer, time.perf_counter() - started


def _case_line(index: str, query: Query, cached: Answer, bypass: Answer, cached_s: float, bypass_s: float) -> str:
    same = "identical" if cached.output == bypass.output else "DIFFERS"
    result = "hit" if cached.cached_tokens > 0 else "miss"
    text = query.query if len(query.query) <= 60 else query.query[:57] + "..."
    return f"{index} {same}: cache {cached_s:.1f} s ({result}), bypass {bypass_s:.1f} s: {text!r}"


def request_body(model: str, tools: list[dict[str, Any]], system: str, query: Query, max_tokens: int,
                 tool_choice: str) -> dict[str, Any]:
    """The request for `query`; `named` names its expected tool."""
    choice: Any = tool_choice
    if tool_choice == "named":
        if query.expected_tool is None:
            raise ValueError("--tool-choice named needs queries that expect a tool (not --response-format)")
        choice = {"type": "function", "function": {"name": query.expected_tool}}
    messages = [{"role": "system", "content": system}, {"role": "user", "content": query.query}]
    body = {"model": model, "messages": messages, "tools": tools, "tool_choice": choice, "temperature": 0,
            "max_tokens": max_tokens}
    if query.response_format is not None:
        body["response_format"] = query.response_format
    return body


def load_queries(path: str | None, tool_names: set[str], structured: bool = False) -> list[Query]:
    """The queries (the built-in retail set when `path` is None, or the structured-output rows);
    each that expects a tool must expect one in the file."""
    if structured:
        queries = list(STRUCTURED_QUERIES)
    elif path is None:
        queries = list(RETAIL_QUERIES)
    else:
        lines = Path(path).read_text().splitlines()
        queries = [Query(**json.loads(line)) for line in lines if line.strip()]
    missing = sorted({q.expected_tool for q in queries if q.expected_tool is not None} - tool_names)
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
    cmd.add_argument("--queries", help='JSON lines {"query", "expected_tool", "response_format"} (the last '
                                       'optional; default: the built-in retail set)')
    cmd.add_argument("--system", default=DEFAULT_SYSTEM, help="the system prompt")
    cmd.add_argument("--tool-choice", choices=TOOL_CHOICES, default="auto",
                     help="'required' forces a call, so accuracy measures the choice of tool alone; 'named' "
                          "names each query's expected tool (both decode under a grammar)")
    cmd.add_argument("--response-format", action="store_true",
                     help="send the bench's structured-output rows (json_schema and json_object, "
                          "gateway/bench/bfcl.py) instead of the tool queries, the tools still in the prompt")
    cmd.add_argument("--max-tokens", type=int, default=64)
    cmd.add_argument("--limit", type=int, help="run only the first N queries")
    cmd.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    cmd.add_argument("--json", action="store_true", help="print the report as one JSON document")
    cmd.set_defaults(func=_parity)


def _parity(args: argparse.Namespace) -> int:
    try:
        tools = json.loads(Path(args.tools).read_text())
        queries = load_queries(args.queries, {t["function"]["name"] for t in tools},
                               args.response_format)[: args.limit]
        client = ParityClient(args.base_url, args.api_key, args.timeout)
        model = args.model or client.model()
        _say(f"{len(queries)} queries to {model} at {args.base_url}, each through the cache and with the bypass "
             "(a CPU server's first may take minutes: it compiles the tool group)")
        report = run_parity(client, model, tools, args.system, queries, args.max_tokens, args.tool_choice,
                            progress=_say)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # urllib's errors are OSErrors
        print(f"toolkv parity: {_describe(exc)}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(report), indent=2) if args.json else "\n".join(report.lines()))
    return 0 if report.identical == report.num_queries else 1


def _say(line: str) -> None:
    """Progress on stderr (the report, maybe JSON, is stdout's), shown at once."""
    print(f"toolkv parity: {line}", file=sys.stderr, flush=True)


def _describe(exc: Exception) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"the server answered {exc.code}: {exc.read().decode(errors='replace')[:500]}"
    return f"{type(exc).__name__}: {exc}"


def _share(count: int, total: int) -> str:
    return f"{count}/{total} ({100 * count / total:.0f}%)" if total else "0/0"
