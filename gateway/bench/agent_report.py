"""The agent scenario's numbers: one row per turn, the summary, the table.

Each turn is one streaming request with the whole conversation so far, as an agent sends it. Per
turn: prompt tokens, cached tokens (the server's `usage.prompt_tokens_details.cached_tokens`),
computed tokens (prompt - cached), new tokens and TTFT. New tokens are the prompt-token delta from
the conversation's previous turn (prompt_k - prompt_k-1): the tokens of the messages added since
(the previous answer as the agent sends it back, tool results, the user's reply), as both prompts
end with the same generation prompt. A server that reuses the previous turn's prompt up to its
generation prompt computes new + that prompt's few tokens; one that reuses only the tool group
computes the whole history. The summary covers every turn after its conversation's first.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table

from gateway.bench.client import Sample
from gateway.bench.stats import percentile

NEW_TOKENS_FROM = "prompt_delta"  # what `new_tokens` means in the report: prompt_k - prompt_k-1


def agent_stats(samples: list[Sample]) -> dict[str, Any]:
    """One row per turn, and the summary over turns after each conversation's first."""
    rows: list[dict[str, Any]] = []
    previous: dict[str, Sample] = {}  # each conversation's turn before
    for s in samples:
        rows.append(_row(s, previous.get(s.group)))
        previous[s.group] = s
    later = [r for r in rows if not r["first_turn"] and r["error"] is None]
    return {"turns": rows, "summary": _summary(later), "new_tokens_from": NEW_TOKENS_FROM,
            "errors": sum(1 for r in rows if r["error"])}


def _row(s: Sample, before: Sample | None) -> dict[str, Any]:
    computed = None if s.prompt_tokens is None or s.cached_tokens is None else s.prompt_tokens - s.cached_tokens
    last = None if before is None else before.prompt_tokens
    new = None if s.prompt_tokens is None or last is None else s.prompt_tokens - last
    return {"conversation": s.group, "task_id": s.tags["task_id"], "trial": s.tags["trial"], "turn": s.tags["turn"],
            "first_turn": before is None, "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
            "computed_tokens": computed, "new_tokens": new,
            "computed_minus_new": computed - new if computed is not None and new is not None else None,
            "ttft_ms": None if s.ttft_s is None else round(s.ttft_s * 1000, 1), "error": s.error}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def p50(key: str) -> float | None:
        return _round(percentile([r[key] for r in rows if r[key] is not None], 50))

    extra = [r["computed_minus_new"] for r in rows if r["computed_minus_new"] is not None]
    ttft = [r["ttft_ms"] for r in rows if r["ttft_ms"] is not None]
    return {"turns": len(rows), "computed_tokens_p50": p50("computed_tokens"), "new_tokens_p50": p50("new_tokens"),
            "computed_minus_new_p50": p50("computed_minus_new"), "computed_minus_new_max": max(extra, default=None),
            "ttft_ms": {"p50": _round(percentile(ttft, 50)), "p95": _round(percentile(ttft, 95))}}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def agent_table(scenario: dict[str, Any]) -> Table:
    table = Table(title="agent: tau-bench conversations replayed turn by turn", box=box.SIMPLE, padding=(0, 1, 0, 0),
                  caption="computed = prompt - cached; new = prompt - the conversation's previous prompt: the "
                          "tokens of the messages added since (prompt delta)")
    for column in ("conversation", "turn", "prompt", "cached", "computed", "new", "computed\n- new", "TTFT ms"):
        table.add_column(column, justify="left" if column == "conversation" else "right", no_wrap=True)
    for r in scenario["turns"]:
        table.add_row(r["conversation"], str(r["turn"]), *(_num(r[k]) for k in (
            "prompt_tokens", "cached_tokens", "computed_tokens", "new_tokens", "computed_minus_new", "ttft_ms")))
    return table


def agent_lines(scenario: dict[str, Any]) -> list[str]:
    s = scenario["summary"]
    ttft = s["ttft_ms"]
    return [f"agent, {s['turns']} turns after each conversation's first: computed tokens p50 "
            f"{_num(s['computed_tokens_p50'])}, computed - new p50 {_num(s['computed_minus_new_p50'])} "
            f"(max {_num(s['computed_minus_new_max'])}), TTFT p50 "
            f"{_num(ttft['p50'])} ms, p95 {_num(ttft['p95'])} ms"]


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"
