"""`toolkv bench --check`: the run against toolkv's own performance targets (report.targets), one
line each with what was measured, and whether any was missed (the command's exit status). The
targets were set on toolkv's development machine with the default model; without `--check` the
bench prints measurements only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from gateway.bench.agent_report import TARGET_EXTRA_TOKENS
from gateway.bench.lab.constrained_report import TARGET_GRAMMAR_SHARE
from gateway.bench.lab.fleet_report import TARGET_HOT_OVER_BALANCED_P95
from gateway.bench.lab.floor_report import hit_overhead
from gateway.bench.lab.history_report import TARGET_HISTORY_RSS_GROWTH
from gateway.bench.lab.hostile import TARGET_B_RATIO as TARGET_HOSTILE_B_RATIO
from gateway.bench.lab.hostile import TARGET_RSS_GROWTH as TARGET_HOSTILE_RSS_GROWTH
from gateway.bench.report import (
    TARGET_COMPILE_OVERLAP_RATIO,
    TARGET_FIRST_OVER_LATER,
    TARGET_OVERHEAD_MS,
    TARGET_RESTART_SPEEDUP,
    TARGET_RSS_GROWTH,
    TARGET_SPEEDUP,
    TARGET_SPEEDUP_TOOLS,
    TARGET_TOKENS_SCALING_4,
    TARGET_TTFT_RATIO_4,
)

Result = Literal["ok", "missed", "not measured"]
Scenarios = dict[str, dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    result: Result
    line: str  # what was measured against what was wanted

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "result": self.result, "line": self.line}


def _x(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _pct_growth(growth: Any, first: Any) -> str:
    if growth is None or not first:
        return "-"
    return f"{growth:+,.0f} MB ({growth / first:+.1%} of {first:,.0f} MB)"


def _single(s: Scenarios, report: dict[str, Any]) -> str:
    return (f"hit TTFT {_x(s.get('single', {}).get('speedup'))} faster than a warm miss (the first request apart) "
            f"(target >= {TARGET_SPEEDUP:g}x on a group of {TARGET_SPEEDUP_TOOLS}+ tools)")


def _overhead(s: Scenarios, report: dict[str, Any]) -> str:
    value = hit_overhead(s, report.get("floor", {}).get("by_tools", {}))
    shown = "-" if value is None else f"{value:+.1f} ms"
    return f"a hit's time above the model's own prefill: {shown} p50 (target < {TARGET_OVERHEAD_MS:g} ms)"


def _interleaved(s: Scenarios, report: dict[str, Any]) -> str:
    sequence = " ".join(s.get("interleaved", {}).get("sequence", []))
    return f"interleaved groups, every repeat a hit: {sequence or '-'}"


def _first(s: Scenarios, report: dict[str, Any]) -> str:
    f = s.get("single", {})
    return (f"a spawned server's first request (a miss): {_x(f.get('first_over_later_miss'))} a later miss of "
            f"its size (target <= {TARGET_FIRST_OVER_LATER:g}x; measured with --spawn)")


def _restart(s: Scenarios, report: dict[str, Any]) -> str:
    r = s.get("restart", {})
    return (f"first request after a restart: a {r.get('first_after_restart', '-')}, {_x(r.get('restart_speedup'))} "
            f"faster than the miss before it (target: a hit, >= {TARGET_RESTART_SPEEDUP:g}x)")


def _ratios(s: Scenarios) -> dict[str, Any]:
    return dict(s.get("concurrent", {}).get("ratios", {}).get("one-group", {}))


def _scaling(s: Scenarios, report: dict[str, Any]) -> str:
    return (f"output tokens/s at 4 clients over 1, one group: {_x(_ratios(s).get('tokens_per_s_4_over_1'))} "
            f"(target >= {TARGET_TOKENS_SCALING_4:g}x)")


def _ttft_ratio(s: Scenarios, report: dict[str, Any]) -> str:
    return (f"hit TTFT p50 at 4 clients over 1, one group: {_x(_ratios(s).get('hit_ttft_p50_4_over_1'))} "
            f"(target <= {TARGET_TTFT_RATIO_4:g}x)")


def _overlap(s: Scenarios, report: dict[str, Any]) -> str:
    ratio = s.get("compile-overlap", {}).get("during_over_alone")
    return (f"hit TTFT p50 while another group compiles over alone: {_x(ratio)} "
            f"(target <= {TARGET_COMPILE_OVERLAP_RATIO:g}x)")


def _soak(s: Scenarios, report: dict[str, Any]) -> str:
    k = s.get("soak", {})
    return (f"server RSS over the soak: {_pct_growth(k.get('rss_growth_mb'), k.get('rss_first_mb'))} "
            f"(target: at most {TARGET_RSS_GROWTH:.0%})")


def _agent(s: Scenarios, report: dict[str, Any]) -> str:
    extra = s.get("agent", {}).get("summary", {}).get("computed_minus_new_max")
    return (f"agent turns: at most {'-' if extra is None else f'{extra:,.0f}'} tokens computed beyond the new "
            f"messages (target <= {TARGET_EXTRA_TOKENS})")


def _history(s: Scenarios, report: dict[str, Any]) -> str:
    h = s.get("history", {})
    return (f"server RSS over the history: {_pct_growth(h.get('rss_growth_mb'), h.get('rss_first_mb'))} "
            f"(target: at most {TARGET_HISTORY_RSS_GROWTH:.0%})")


def _valid(s: Scenarios, report: dict[str, Any]) -> str:
    c = s.get("constrained", {})
    return f"constrained answers valid: {c.get('valid', '-')}/{c.get('requests', '-')} (target: all)"


def _grammar(s: Scenarios, report: dict[str, Any]) -> str:
    share = (s.get("constrained", {}).get("cost") or {}).get("all", {}).get("grammar_share_of_decode")
    shown = "-" if share is None else f"{share:.1%}"
    return f"the grammar's time per token over a decode step's: {shown} (target <= {TARGET_GRAMMAR_SHARE:.0%})"


def _fleet(s: Scenarios) -> dict[str, Any]:
    return dict(s.get("fleet", {}))


def _fleet_hits(s: Scenarios, report: dict[str, Any]) -> str:
    rate = _fleet(s).get("interleaved", {}).get("after_first", {}).get("hit_rate")
    shown = "-" if rate is None else f"{rate:.0%}"
    return f"fleet: hits among each group's requests after its first: {shown} (target: all)"


def _fleet_once(s: Scenarios, report: dict[str, Any]) -> str:
    inter = _fleet(s).get("interleaved", {})
    return (f"fleet: groups compiled once, on one replica: {inter.get('groups_compiled_once', '-')} of "
            f"{len(inter.get('by_group', {}))} (target: all)")


def _fleet_spreads(s: Scenarios, report: dict[str, Any]) -> str:
    reached = _fleet(s).get("hot", {}).get("replicas_reached", [])
    return f"fleet: a hot group's requests reached {len(reached)} replica(s) (target: more than one)"


def _fleet_p95(s: Scenarios, report: dict[str, Any]) -> str:
    ratio = _fleet(s).get("hot_over_balanced_p95")
    return (f"fleet: the hot group's hit TTFT p95 over the balanced case's: {_x(ratio)} "
            f"(target <= {TARGET_HOT_OVER_BALANCED_P95:g}x)")


def _hostile_b(s: Scenarios, report: dict[str, Any]) -> str:
    ratio = s.get("hostile-soak", {}).get("b_ratio_p50")
    return (f"hostile-soak: key B's latency p50 under attack over alone: {_x(ratio)} "
            f"(target <= {TARGET_HOSTILE_B_RATIO:g}x)")


def _hostile_rss(s: Scenarios, report: dict[str, Any]) -> str:
    h = s.get("hostile-soak", {})
    return (f"hostile-soak: server RSS {_pct_growth(h.get('rss_growth_mb'), h.get('rss_start_mb'))} "
            f"(target: at most {TARGET_HOSTILE_RSS_GROWTH:.0%})")


def _hostile_5xx(s: Scenarios, report: dict[str, Any]) -> str:
    h = s.get("hostile-soak", {})
    return (f"hostile-soak: {h.get('hostile_failures', '-')} hostile requests answered 5xx or dropped, key B "
            f"errors {h.get('b_errors', '-')} (target: none)")


DESCRIBE: dict[str, Callable[[Scenarios, dict[str, Any]], str]] = {
    "hit_speedup_at_least_15x": _single,
    "hit_overhead_under_20ms": _overhead,
    "first_request_at_most_2x_a_later_miss": _first,
    "interleaved_every_repeat_hits": _interleaved,
    "restart_at_least_10x_faster": _restart,
    "tokens_per_s_4_clients_at_least_2_5x": _scaling,
    "hit_ttft_4_clients_at_most_2x": _ttft_ratio,
    "hit_ttft_during_compile_at_most_4x": _overlap,
    "rss_flat_over_soak": _soak,
    "agent_computes_only_new_messages": _agent,
    "history_rss_flat": _history,
    "constrained_all_valid": _valid,
    "constraint_cost_at_most_10pct_of_decode": _grammar,
    "fleet_hits_after_first": _fleet_hits,
    "fleet_first_compile_on_one_replica": _fleet_once,
    "fleet_hot_spreads": _fleet_spreads,
    "fleet_hot_p95_within_2x_balanced": _fleet_p95,
    "hostile_b_within_2x": _hostile_b,
    "hostile_rss_bounded": _hostile_rss,
    "hostile_no_5xx": _hostile_5xx,
}


def checks(report: dict[str, Any]) -> list[Check]:
    """Every target of the report, in its order: ok, missed, or not measured by this run."""
    out = []
    for name, met in report["targets"].items():
        result: Result = "not measured" if met is None else ("ok" if met else "missed")
        describe = DESCRIBE.get(name)
        line = describe(report["scenarios"], report) if describe is not None else name
        out.append(Check(name, result, line))
    return out


def check_lines(found: list[Check]) -> list[str]:
    """A summary line, then one line per measured target (missed ones first, each with its reason)."""
    missed = [c for c in found if c.result == "missed"]
    passed = [c for c in found if c.result == "ok"]
    unmeasured = [c.name for c in found if c.result == "not measured"]
    lines = [f"check: {len(missed)} of {len(missed) + len(passed)} measured targets missed"
             + (f" ({len(unmeasured)} not measured by this run's scenarios)" if unmeasured else "")]
    lines += [f"  MISSED {c.name}: {c.line}" for c in missed]
    lines += [f"  ok     {c.name}: {c.line}" for c in passed]
    return lines
