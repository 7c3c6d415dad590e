"""Every performance target of toolkv, in one table: its name, what it measures, its threshold, and
how a report decides it (met, missed, or None: not measured by this run). The lab checks a run
against them (`toolkv bench --lab`): one line each with what was measured, and whether any was
missed (the command's exit status). They were set on toolkv's development machine with the default
model; the bench a user runs prints measurements only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from gateway.bench.context import Scenarios
from gateway.bench.lab.floor_report import hit_overhead

Result = Literal["ok", "missed", "not measured"]
Report = dict[str, Any]

SPEEDUP = 15.0  # single: hit TTFT against a warm miss, on a group of SPEEDUP_TOOLS+ tools
SPEEDUP_TOOLS = 20  # a smaller group's miss is cheaper: its speedup is no measure of this target
OVERHEAD_MS = 20.0  # a hit's time above the model's own suffix prefill
FIRST_OVER_LATER = 2.0  # a spawned server's first request (a miss) over a later miss of its size
RESTART_SPEEDUP = 10.0  # the first request after a restart (a hit from disk) over the miss before it
TOKENS_SCALING_4 = 2.5  # one group: 4 clients' output tokens/s over 1 client's
TTFT_RATIO_4 = 2.0  # one group: 4 clients' hit TTFT p50 over 1 client's
COMPILE_OVERLAP = 4.0  # a hit's TTFT p50 while another group compiles, over alone
SOAK_RSS_GROWTH = 0.05  # soak: RSS from 10% to 100% of the run grows by at most this share
AGENT_EXTRA_TOKENS = 16  # agent: after a conversation's first turn, its new messages within one KV block
HISTORY_RSS_GROWTH = 0.05  # history: RSS from the first reading (10%) to the last
GRAMMAR_SHARE = 0.10  # constrained: the grammar's time per token over a decode step's
HOT_OVER_BALANCED_P95 = 2.0  # fleet: the hot group's hit TTFT p95 over the balanced case's
HOSTILE_B_RATIO = 2.0  # hostile-soak: key B's p50 latency under attack over alone
HOSTILE_RSS_GROWTH = 0.25  # hostile-soak: RSS from key A's start to the end


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    measures: str  # what, in words
    threshold: str  # the bar, in words
    met: Callable[[Scenarios, Report], bool | None]  # None: not measured by this run
    shown: Callable[[Scenarios, Report], str]  # what was measured, in words


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    result: Result
    line: str  # what was measured against what was wanted

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "result": self.result, "line": self.line}


def _at_most(value: Any, bar: float) -> bool | None:
    return None if value is None else value <= bar


def _growth_within(part: dict[str, Any], first_key: str, share: float) -> bool | None:
    growth, first = part.get("rss_growth_mb"), part.get(first_key)
    return None if growth is None or not first else growth <= share * first


def _x(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _growth(part: dict[str, Any], first_key: str) -> str:
    growth, first = part.get("rss_growth_mb"), part.get(first_key)
    return "-" if growth is None or not first else f"{growth:+,.0f} MB ({growth / first:+.1%} of {first:,.0f} MB)"


def _ratio(name: str, measures: str, scenario: str, key: str, bar: float) -> Target:
    """A target on one ratio a scenario measured: at most `bar`."""
    return Target(name, measures, f"<= {bar:g}x", lambda s, r: _at_most(_ran(s, scenario).get(key), bar),
                  lambda s, r: _x(_ran(s, scenario).get(key)))


def _ran(s: Scenarios, name: str) -> dict[str, Any]:
    """A scenario's numbers when it ran (empty when it did not or was skipped)."""
    part = s.get(name, {})
    return {} if part.get("skipped") else dict(part)


def _speedup(s: Scenarios, r: Report) -> bool | None:
    single = _ran(s, "single")
    tools = max((sample["num_tools"] for sample in single.get("samples", [])), default=SPEEDUP_TOOLS)
    return None if tools < SPEEDUP_TOOLS or single.get("speedup") is None else single["speedup"] >= SPEEDUP


def _overhead(s: Scenarios, r: Report) -> float | None:
    return hit_overhead(s, r.get("floor", {}).get("by_tools", {}))


def _first(s: Scenarios, r: Report) -> bool | None:
    single = _ran(s, "single")
    return _at_most(single.get("first_over_later_miss"), FIRST_OVER_LATER) if single.get("first_after_start") else None


def _restart(s: Scenarios, r: Report) -> bool | None:
    restart = _ran(s, "restart")
    speedup = restart.get("restart_speedup") if restart.get("first_after_restart") == "hit" else None
    return None if not restart else speedup is not None and speedup >= RESTART_SPEEDUP


def _one_group(s: Scenarios) -> dict[str, Any]:
    return dict(_ran(s, "concurrent").get("ratios", {}).get("one-group", {}))


def _scaling(s: Scenarios, r: Report) -> bool | None:
    value = _one_group(s).get("tokens_per_s_4_over_1")
    return None if value is None else value >= TOKENS_SCALING_4


def _agent_extra(s: Scenarios) -> Any:
    return _ran(s, "agent").get("summary", {}).get("computed_minus_new_max")


def _grammar_share(s: Scenarios) -> Any:
    return (_ran(s, "constrained").get("cost") or {}).get("all", {}).get("grammar_share_of_decode")


def _valid(s: Scenarios, r: Report) -> bool | None:
    c = _ran(s, "constrained")
    return c.get("all_valid") if c.get("requests") else None


def _inter(s: Scenarios) -> dict[str, Any]:
    return dict(_ran(s, "fleet").get("interleaved", {}))


def _fleet_hits(s: Scenarios, r: Report) -> bool | None:
    after = _inter(s).get("after_first", {})
    return after["hit_rate"] == 1.0 if after.get("n") else None


def _fleet_once(s: Scenarios, r: Report) -> bool | None:
    once = _inter(s).get("groups_compiled_once")
    return None if once is None else once == len(_inter(s)["by_group"])


def _fleet_spreads(s: Scenarios, r: Report) -> bool | None:
    fleet = _ran(s, "fleet")
    return len(fleet["hot"]["replicas_reached"]) > 1 if fleet else None


def _hostile_clean(s: Scenarios, r: Report) -> bool | None:
    h = _ran(s, "hostile-soak")
    return h.get("hostile_failures", 0) == 0 and h.get("b_errors", 0) == 0 if h else None


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value:.1%}"


TARGETS = (
    Target("hit_speedup_at_least_15x", "hit TTFT faster than a warm miss (the first request apart)",
           f">= {SPEEDUP:g}x on a group of {SPEEDUP_TOOLS}+ tools", _speedup,
           lambda s, r: _x(_ran(s, "single").get("speedup"))),
    Target("hit_overhead_under_20ms", "a hit's time above the model's own prefill, p50", f"< {OVERHEAD_MS:g} ms",
           lambda s, r: None if (v := _overhead(s, r)) is None else v < OVERHEAD_MS,
           lambda s, r: "-" if (v := _overhead(s, r)) is None else f"{v:+.1f} ms"),
    Target("first_request_at_most_2x_a_later_miss", "a spawned server's first request (a miss) over a later miss",
           f"<= {FIRST_OVER_LATER:g}x; measured with --spawn", _first,
           lambda s, r: _x(_ran(s, "single").get("first_over_later_miss"))),
    Target("interleaved_every_repeat_hits", "interleaved groups, every repeat a hit", "all",
           lambda s, r: _ran(s, "interleaved").get("every_repeat_hit"),
           lambda s, r: " ".join(_ran(s, "interleaved").get("sequence", [])) or "-"),
    Target("restart_at_least_10x_faster", "the first request after a restart over the miss before it",
           f"a hit, >= {RESTART_SPEEDUP:g}x", _restart,
           lambda s, r: f"a {_ran(s, 'restart').get('first_after_restart', '-')}, "
                        f"{_x(_ran(s, 'restart').get('restart_speedup'))}"),
    Target("tokens_per_s_4_clients_at_least_2_5x", "output tokens/s at 4 clients over 1, one group",
           f">= {TOKENS_SCALING_4:g}x", _scaling, lambda s, r: _x(_one_group(s).get("tokens_per_s_4_over_1"))),
    Target("hit_ttft_4_clients_at_most_2x", "hit TTFT p50 at 4 clients over 1, one group", f"<= {TTFT_RATIO_4:g}x",
           lambda s, r: _at_most(_one_group(s).get("hit_ttft_p50_4_over_1"), TTFT_RATIO_4),
           lambda s, r: _x(_one_group(s).get("hit_ttft_p50_4_over_1"))),
    _ratio("hit_ttft_during_compile_at_most_4x", "hit TTFT p50 while another group compiles over alone",
           "compile-overlap", "during_over_alone", COMPILE_OVERLAP),
    Target("rss_flat_over_soak", "server RSS over the soak", f"at most {SOAK_RSS_GROWTH:.0%}",
           lambda s, r: _growth_within(_ran(s, "soak"), "rss_first_mb", SOAK_RSS_GROWTH),
           lambda s, r: _growth(_ran(s, "soak"), "rss_first_mb")),
    Target("agent_computes_only_new_messages", "agent turns: tokens computed beyond the new messages, at most",
           f"<= {AGENT_EXTRA_TOKENS}", lambda s, r: _at_most(_agent_extra(s), AGENT_EXTRA_TOKENS),
           lambda s, r: "-" if (v := _agent_extra(s)) is None else f"{v:,.0f}"),
    Target("history_rss_flat", "server RSS over the history", f"at most {HISTORY_RSS_GROWTH:.0%}",
           lambda s, r: _growth_within(_ran(s, "history"), "rss_first_mb", HISTORY_RSS_GROWTH),
           lambda s, r: _growth(_ran(s, "history"), "rss_first_mb")),
    Target("constrained_all_valid", "constrained answers valid", "all", _valid,
           lambda s, r: f"{_ran(s, 'constrained').get('valid', '-')}/{_ran(s, 'constrained').get('requests', '-')}"),
    Target("constraint_cost_at_most_10pct_of_decode", "the grammar's time per token over a decode step's",
           f"<= {GRAMMAR_SHARE:.0%}", lambda s, r: _at_most(_grammar_share(s), GRAMMAR_SHARE),
           lambda s, r: _pct(_grammar_share(s))),
    Target("fleet_hits_after_first", "fleet: hits among each group's requests after its first", "all", _fleet_hits,
           lambda s, r: "-" if (v := _inter(s).get("after_first", {}).get("hit_rate")) is None else f"{v:.0%}"),
    Target("fleet_first_compile_on_one_replica", "fleet: groups compiled once, on one replica", "all", _fleet_once,
           lambda s, r: f"{_inter(s).get('groups_compiled_once', '-')} of {len(_inter(s).get('by_group', {}))}"),
    Target("fleet_hot_spreads", "fleet: replicas a hot group's requests reached", "more than one", _fleet_spreads,
           lambda s, r: str(len(_ran(s, "fleet").get("hot", {}).get("replicas_reached", [])))),
    _ratio("fleet_hot_p95_within_2x_balanced", "fleet: the hot group's hit TTFT p95 over the balanced case's",
           "fleet", "hot_over_balanced_p95", HOT_OVER_BALANCED_P95),
    _ratio("hostile_b_within_2x", "hostile-soak: key B's latency p50 under attack over alone",
           "hostile-soak", "b_ratio_p50", HOSTILE_B_RATIO),
    Target("hostile_rss_bounded", "hostile-soak: server RSS", f"at most {HOSTILE_RSS_GROWTH:.0%}",
           lambda s, r: _growth_within(_ran(s, "hostile-soak"), "rss_start_mb", HOSTILE_RSS_GROWTH),
           lambda s, r: _growth(_ran(s, "hostile-soak"), "rss_start_mb")),
    Target("hostile_no_5xx", "hostile-soak: hostile requests answered 5xx or dropped, key B's errors", "none",
           _hostile_clean, lambda s, r: f"{_ran(s, 'hostile-soak').get('hostile_failures', '-')}, "
                                        f"{_ran(s, 'hostile-soak').get('b_errors', '-')}"),
)


def targets(report: Report) -> dict[str, bool | None]:
    """Each target of the table: met, missed, or None (not measured by this run)."""
    return {t.name: t.met(report["scenarios"], report) for t in TARGETS}


def checks(report: Report) -> list[Check]:
    """Every target, in the table's order: ok, missed, or not measured by this run."""
    out = []
    for t in TARGETS:
        met = t.met(report["scenarios"], report)
        result: Result = "not measured" if met is None else ("ok" if met else "missed")
        out.append(Check(t.name, result, f"{t.measures}: {t.shown(report['scenarios'], report)} "
                                         f"(target {t.threshold})"))
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
