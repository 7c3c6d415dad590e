"""The report: numbers from samples (p50/p95 per class: miss, hit, bypass; speedup = miss p50 /
hit p50, from warm misses: the single scenario's first request is reported apart; the floor and a
hit's overhead above it), each scenario's own numbers from its report module (concurrency_report,
floor_report, agent_report, history_report, constrained_report, fleet_report), the issues'
targets, the JSON report, the main table and the findings' lines."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from gateway.bench.agent_report import agent_lines, agent_stats, agent_table, agent_target
from gateway.bench.client import Sample
from gateway.bench.concurrency_report import (
    CONCURRENCY_SCENARIOS,
    concurrency_lines,
    concurrency_table,
    concurrent_stats,
    overlap_stats,
)
from gateway.bench.context import ScenarioResult
from gateway.bench.forced import forced_lines
from gateway.bench.lab.constrained_report import (
    constrained_lines,
    constrained_stats,
    constrained_table,
    constrained_targets,
)
from gateway.bench.lab.fleet_report import fleet_lines, fleet_stats, fleet_table, fleet_targets
from gateway.bench.lab.floor import FloorResult
from gateway.bench.lab.floor_report import FLOOR_SHARES_CPU, floor_dict, floor_lines, hit_overhead
from gateway.bench.lab.history_report import history_lines, history_stats, history_target
from gateway.bench.lab.hostile import hostile_lines, hostile_targets
from gateway.bench.memory import memory_lines
from gateway.bench.peer_report import peer_lines, peer_stats, peer_table
from gateway.bench.stats import decode_s_per_token, ms_spread, num, output_tokens, percentile, ratio, rounded, to_ms

CLASSES = ("miss", "hit", "bypass")
REPORT_VERSION = 1
# The single scenario's targets, for the default model and a 20-tool group.
TARGET_SPEEDUP = 15.0
TARGET_SPEEDUP_TOOLS = 20  # a smaller group's miss is cheaper: its speedup is no measure of this target
TARGET_OVERHEAD_MS = 20.0
TARGET_RESTART_SPEEDUP = 10.0
TARGET_FIRST_OVER_LATER = 2.0  # a spawned server's first request (a miss) over a later miss of its size
# The concurrency targets, one group: 4 clients' output tokens/s over 1 client's, their hit
# TTFT p50 over 1 client's, and a hit's TTFT p50 while another group compiles over alone.
TARGET_TOKENS_SCALING_4 = 2.5
TARGET_TTFT_RATIO_4 = 2.0
TARGET_COMPILE_OVERLAP_RATIO = 4.0
TARGET_RSS_GROWTH = 0.05  # soak: RSS from 10% to 100% of the run grows by at most this share


def class_stats(samples: list[Sample]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for cls in CLASSES:
        chosen = [s for s in samples if s.cache == cls]
        rates = [r for s in chosen if (r := s.decode_tokens_per_s) is not None]
        out[cls] = {"n": len(chosen),
                    "ttft_ms": ms_spread([s.ttft_s for s in chosen if s.ttft_s is not None]),
                    "total_ms": ms_spread([s.total_s for s in chosen]),
                    "decode_tokens_per_s_p50": rounded(percentile(rates, 50), 2),
                    "cached_tokens_p50": rounded(percentile([s.cached_tokens or 0 for s in chosen], 50), 0),
                    "prompt_tokens_p50": rounded(percentile([s.prompt_tokens or 0 for s in chosen], 50), 0)}
    out["errors"] = {"n": sum(1 for s in samples if s.cache == "error"),
                     "messages": sorted({s.error for s in samples if s.error})[:5]}
    return out


def block(samples: list[Sample], floors: dict[int, FloorResult]) -> dict[str, Any]:
    """Stats, speedups, floor and overhead for a set of samples of one group shape. The floor is
    the model's own suffix prefill as the server timed it for each hit (else the in-process probe's)."""
    stats = class_stats(samples)
    miss, hit, bypass = (stats[c]["ttft_ms"]["p50"] for c in CLASSES)
    per_token = [t for s in samples if s.cache != "error" and (t := decode_s_per_token(s)) is not None]
    out: dict[str, Any] = {"classes": stats, "speedup": ratio(miss, hit), "speedup_vs_bypass": ratio(bypass, hit),
                           "decode_ms_per_token": {"n": len(per_token), **ms_spread(per_token)},
                           "output_tokens_p50": rounded(percentile([output_tokens(s) for s in samples], 50), 0)}
    timed = [s for s in samples if s.cache == "hit" and s.overhead_ms is not None]
    if timed:  # the server split each hit's time: overhead paired per request
        overheads = [s.overhead_ms for s in timed if s.overhead_ms is not None]
        out["floor_ms_p50"] = rounded(percentile([s.model_prefill_ms or 0.0 for s in timed], 50), 1)
        out["hit_overhead_ms"] = rounded(percentile(overheads, 50), 1)
        out["hit_overhead_ms_p95"] = rounded(percentile(overheads, 95), 1)
        out["overhead_from"] = "server-timing"
        return out
    aligned = [s.ttft_s for s in samples if s.cache == "hit" and s.tool_offset == 0 and s.ttft_s is not None]
    sizes = {s.num_tools for s in samples}
    floor = floors.get(sizes.pop()) if len(sizes) == 1 else None  # a floor is per group size
    if floor is not None and aligned:
        floor_p50 = percentile(floor.floor_ms, 50)
        hit_p50 = to_ms(percentile(aligned, 50))
        out["floor_ms_p50"] = rounded(floor_p50, 1)
        out["hit_overhead_ms"] = _overhead(hit_p50, floor_p50)
        out["overhead_from"] = "probe"
    return out


def _overhead(hit_ms: float | None, floor_ms: float | None) -> float | None:
    """A hit's time above the floor; None when the floor took longer than the hit itself (the floor
    was measured under other load, e.g. beside the server on the same cores): no overhead to tell."""
    if hit_ms is None or not floor_ms or hit_ms < floor_ms:
        return None
    return round(hit_ms - floor_ms, 1)


def scenario_dict(result: ScenarioResult, floors: dict[int, FloorResult]) -> dict[str, Any]:
    out: dict[str, Any] = {"skipped": result.skipped, "notes": result.notes, **result.details}
    if result.skipped:
        return out
    counts = sorted({s.num_tools for s in result.samples})
    if result.name == "toolcount":  # one block per size: a speedup across sizes means nothing
        out["by_tools"] = {str(n): block([s for s in result.samples if s.num_tools == n], floors) for n in counts}
    elif result.name == "concurrent":  # per case; warm-up requests are not measured
        out.update(concurrent_stats(result.samples, result.details.get("cases", [])))
    elif result.name == "compile-overlap":
        out.update(overlap_stats(result.samples))
    elif result.name == "agent":  # one row per turn
        out.update(agent_stats(result.samples))
    elif result.name == "history":  # about memory too
        out.update(history_stats(result.samples))
    elif result.name == "constrained":  # about validity and the grammar's cost
        out.update(constrained_stats(result.samples, result.details))
    elif result.name == "hostile-soak":  # its numbers are in details (hostile.py)
        pass
    elif result.name == "peer":  # per server, side by side
        out.update(peer_stats(result.samples, result.details))
    elif result.name == "fleet":  # about routing: per part, replica and group
        out.update(fleet_stats(result.samples, result.details))
    elif result.name == "single":  # the first request has its own line: the miss column is warm misses
        out.update(block(warm_samples(result.samples), floors))
    elif result.name == "soak":  # about memory: the samples' timings are in `samples`
        out["errors"] = sum(1 for s in result.samples if s.cache == "error")
    else:
        out.update(block(result.samples, floors))
    out["samples"] = [s.to_dict() for s in result.samples]
    return out


def warm_samples(samples: list[Sample]) -> list[Sample]:
    """The single scenario's samples without its first request when that was a miss and a later
    miss exists: the first compile after a start (or the bench's first) pays one-time costs, and as
    one of two misses (`--quick`) it was half the median (74x where warm misses gave ~20x)."""
    if samples and samples[0].cache == "miss" and any(s.cache == "miss" for s in samples[1:]):
        return samples[1:]
    return samples


def targets(scenarios: dict[str, dict[str, Any]], floors: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The issues' targets, checked where the run measured them (None: not measured); the overhead
    as `hit_overhead` picks it. Printed only with `--check` (checks.py)."""
    single, inter, restart = (scenarios.get(n, {}) for n in ("single", "interleaved", "restart"))
    speedup, overhead = single.get("speedup"), hit_overhead(scenarios, floors)
    if max((sample["num_tools"] for sample in single.get("samples", [])), default=TARGET_SPEEDUP_TOOLS) \
            < TARGET_SPEEDUP_TOOLS:
        speedup = None
    first_ratio: float | None = single.get("first_over_later_miss")
    restart_speedup = restart.get("restart_speedup") if restart.get("first_after_restart") == "hit" else None
    one_group = scenarios.get("concurrent", {}).get("ratios", {}).get("one-group", {})
    scaling, ttft_ratio = one_group.get("tokens_per_s_4_over_1"), one_group.get("hit_ttft_p50_4_over_1")
    overlap = scenarios.get("compile-overlap", {}).get("during_over_alone")
    soak = scenarios.get("soak", {})
    growth, first = soak.get("rss_growth_mb"), soak.get("rss_first_mb")
    return {
        "hit_speedup_at_least_15x": None if speedup is None else speedup >= TARGET_SPEEDUP,
        "hit_overhead_under_20ms": None if overhead is None else overhead < TARGET_OVERHEAD_MS,
        "first_request_at_most_2x_a_later_miss": (None if first_ratio is None or not single.get("first_after_start")
                                                  else first_ratio <= TARGET_FIRST_OVER_LATER),
        "interleaved_every_repeat_hits": inter.get("every_repeat_hit"),
        "restart_at_least_10x_faster": (None if restart.get("skipped") or not restart else
                                        restart_speedup is not None and restart_speedup >= TARGET_RESTART_SPEEDUP),
        "tokens_per_s_4_clients_at_least_2_5x": None if scaling is None else scaling >= TARGET_TOKENS_SCALING_4,
        "hit_ttft_4_clients_at_most_2x": None if ttft_ratio is None else ttft_ratio <= TARGET_TTFT_RATIO_4,
        "hit_ttft_during_compile_at_most_4x": None if overlap is None else overlap <= TARGET_COMPILE_OVERLAP_RATIO,
        "rss_flat_over_soak": None if growth is None or not first else growth <= TARGET_RSS_GROWTH * first,
        "agent_computes_only_new_messages": agent_target(scenarios.get("agent", {})),
        "history_rss_flat": history_target(scenarios.get("history", {})),
        **constrained_targets(scenarios.get("constrained", {})),
        **fleet_targets(scenarios.get("fleet", {})),
        **hostile_targets(scenarios.get("hostile-soak", {})),
    }


def build_report(meta: dict[str, Any], results: list[ScenarioResult], floors: dict[int, FloorResult],
                 floor_skipped: str | None, floor_shares_cpu: bool = False) -> dict[str, Any]:
    """The whole report. A floor measured beside the server on the same machine (`--floor`) is
    kept, labelled unreliable, and never stands in for the server's own per-request timing."""
    shares_cpu = floor_shares_cpu and bool(floors)
    probe = {n: f for n, f in floors.items() if not shares_cpu}
    scenarios = {r.name: scenario_dict(r, probe) for r in results}
    by_tools = {str(n): floor_dict(f, shares_cpu) for n, f in sorted(floors.items())}
    floor = {"skipped": floor_skipped, "note": FLOOR_SHARES_CPU if shares_cpu else None, "by_tools": by_tools}
    return {"toolkv_bench": REPORT_VERSION, **meta, "scenarios": scenarios, "floor": floor,
            "targets": targets(scenarios, by_tools)}


# Reported on lines of their own, not in the main table.
OWN_LINE_SCENARIOS = (*CONCURRENCY_SCENARIOS, "soak", "agent", "history", "constrained", "fleet", "hostile-soak",
                      "peer")
SUMMARY_COLUMNS = ("scenario", "tools", "n", "miss", "hit", "bypass", "speedup", "floor", "overhead")
SUMMARY_CAPTION = ("p50 TTFT in ms (p95 in the JSON); n = misses/hits/bypasses (single: warm misses, the first "
                   "request on its own line); floor = the model's own suffix prefill on a hit; overhead = hit TTFT - "
                   "floor, per request")


def summary_rows(report: dict[str, Any]) -> list[list[str]]:
    """The main table's rows (SUMMARY_COLUMNS): one per scenario timed by cache class, or per tool count."""
    out = []
    for name, scenario in report["scenarios"].items():
        if name in OWN_LINE_SCENARIOS:
            continue
        if scenario.get("skipped"):
            out.append([name, "", "skipped", *[""] * 6])
            continue
        rows = scenario["by_tools"].items() if "by_tools" in scenario else [("", scenario)]
        out += [[name, tools or _tools_of(scenario), *_cells(data)] for tools, data in rows]
    return out


def print_table(report: dict[str, Any], console: Console) -> None:
    """The measurements: the tables, then a line per finding (no targets: those are `--check`'s)."""
    table = Table(title=f"toolkv bench: {report.get('model')} at {report.get('base_url')}", box=box.SIMPLE,
                  caption=SUMMARY_CAPTION)
    for column in SUMMARY_COLUMNS:
        table.add_column(column, justify="left" if column == "scenario" else "right", no_wrap=True)
    for row in summary_rows(report):
        table.add_row(*row)
    if table.rows:
        console.print(table)
    concurrency = concurrency_table(report)
    if concurrency is not None:
        console.print(concurrency)
    agent = report["scenarios"].get("agent")
    if agent and not agent.get("skipped"):
        console.print(agent_table(agent))
    constrained = report["scenarios"].get("constrained")
    if constrained and not constrained.get("skipped"):
        console.print(constrained_table(constrained))
    fleet = report["scenarios"].get("fleet")
    if fleet and not fleet.get("skipped"):
        console.print(fleet_table(fleet))
    peer = report["scenarios"].get("peer")
    if peer and not peer.get("skipped"):
        console.print(peer_table(peer, peer["peer_url"]))
    for line in summary_lines(report):
        console.print(line, highlight=False)


def _tools_of(scenario: dict[str, Any]) -> str:
    return ",".join(sorted({str(s["num_tools"]) for s in scenario.get("samples", [])}, key=int))


def _cells(data: dict[str, Any]) -> list[str]:
    cls = data["classes"]

    def spread(c: str) -> str:
        t = cls[c]["ttft_ms"]
        return "-" if t["p50"] is None else f"{t['p50']:.0f}"

    counts = "/".join(str(cls[c]["n"]) for c in CLASSES)
    speedup = "-" if data.get("speedup") is None else f"{data['speedup']:.1f}x"
    floor = "-" if data.get("floor_ms_p50") is None else f"{data['floor_ms_p50']:.0f}"
    over = "-" if data.get("hit_overhead_ms") is None else f"{data['hit_overhead_ms']:+.1f}"
    return [counts, spread("miss"), spread("hit"), spread("bypass"), speedup, floor, over]


def summary_lines(report: dict[str, Any]) -> list[str]:
    s = report["scenarios"]
    lines = []
    if "interleaved" in s and not s["interleaved"].get("skipped"):
        i = s["interleaved"]
        sequence = " ".join(i["sequence"])
        lines.append(f"interleaved {i['order']}: {sequence} -> every repeat hit: {i['every_repeat_hit']}")
    if "single" in s and not s["single"].get("skipped") and s["single"]["decode_ms_per_token"]["n"]:
        d, tokens = s["single"]["decode_ms_per_token"], s["single"]["output_tokens_p50"]
        lines.append(f"single: decode, one stream at a time: {num(d['p50'], 1)} ms/token p50 ({num(d['p95'], 1)} p95) "
                     f"over {d['n']} answers of {num(tokens)} tokens")
    if "single" in s and s["single"].get("first_over_later_miss") is not None:
        f = s["single"]
        after = "the first after the server started" if f["first_after_start"] else "the bench's first"
        lines.append(f"single: the first request ({after}, a miss) took {num(f['first_miss_ttft_ms'])} ms, "
                     f"{f['first_over_later_miss']}x a later miss of the same size"
                     + (f" (load average {f['first_load_average']} on {f['num_cpus']} cores)"
                        if f.get("first_load_average") is not None else ""))
    if "restart" in s and not s["restart"].get("skipped"):
        r = s["restart"]
        lines.append(f"restart: first request after restart was a {r['first_after_restart']}, "
                     f"{r['restart_speedup']}x faster than the miss before it (restart took {r['restart_s']} s)")
    lines += concurrency_lines(s)
    lines += forced_lines(s)
    if "soak" in s and not s["soak"].get("skipped"):
        k = s["soak"]
        shown = ", ".join(f"{r['rss_mb']:,.0f}" for r in k["rss_mb"] if r["rss_mb"] is not None)
        lines.append(f"soak: {k['requests']:,} requests over {k['groups']} groups from {k['clients']} clients, "
                     f"{k['errors']} errors; server RSS (MB) every 10%: {shown}; growth "
                     f"{num(k['rss_growth_mb'])} MB")
    if "agent" in s and not s["agent"].get("skipped"):
        lines += agent_lines(s["agent"])
    if "history" in s and not s["history"].get("skipped"):
        lines += history_lines(s["history"])
    if "constrained" in s and not s["constrained"].get("skipped"):
        lines += constrained_lines(s["constrained"])
    if "fleet" in s and not s["fleet"].get("skipped"):
        lines += fleet_lines(s["fleet"])
    if "hostile-soak" in s and not s["hostile-soak"].get("skipped"):
        lines += hostile_lines(s["hostile-soak"])
    if "peer" in s and not s["peer"].get("skipped"):
        lines += peer_lines(s["peer"])
    for name, scenario in s.items():
        lines += [f"{name}: skipped, {scenario['skipped']}"] if scenario.get("skipped") else []
        lines += [f"{name}: {note}" for note in scenario.get("notes", [])]
    lines += floor_lines(report["floor"])
    return lines + memory_lines(report.get("memory"))
