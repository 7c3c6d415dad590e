"""The report: numbers from samples (p50/p95 per class: miss, hit, bypass; speedup = miss p50 /
hit p50, from warm misses: the single scenario's first request is reported apart; a hit's overhead
above the model's own prefill), each scenario's own numbers from its `Scenario.stats`, the JSON
report, the main table and the findings' lines. It knows scenarios only through the registry it is
given (scenarios.SCENARIOS, or the lab's with its own), so the lab adds to it without changing it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from gateway.bench.client import Sample
from gateway.bench.context import Floors, Scenario, ScenarioResult, Scenarios
from gateway.bench.forced import forced_lines
from gateway.bench.memory import memory_lines
from gateway.bench.stats import decode_s_per_token, ms_spread, num, output_tokens, percentile, ratio, rounded, to_ms

CLASSES = ("miss", "hit", "bypass")
REPORT_VERSION = 1


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


def block(samples: list[Sample], floors: Floors) -> dict[str, Any]:
    """Stats, speedups, floor and overhead for a set of samples of one group shape. The floor is
    the model's own suffix prefill as the server timed it for each hit (else the lab's probe's)."""
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
        floor_p50 = percentile(list(floor), 50)
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


def scenario_dict(result: ScenarioResult, registry: Mapping[str, Scenario], floors: Floors) -> dict[str, Any]:
    out: dict[str, Any] = {"skipped": result.skipped, "notes": result.notes, **result.details}
    if result.skipped:
        return out
    stats = registry[result.name].stats
    out.update(block(result.samples, floors) if stats is None else stats(result, floors))
    out["samples"] = [s.to_dict() for s in result.samples]
    return out


def warm_samples(samples: list[Sample]) -> list[Sample]:
    """The single scenario's samples without its first request when that was a miss and a later
    miss exists: the first compile after a start (or the bench's first) pays one-time costs, and as
    one of two misses (`--quick`) it was half the median (74x where warm misses gave ~20x)."""
    if samples and samples[0].cache == "miss" and any(s.cache == "miss" for s in samples[1:]):
        return samples[1:]
    return samples


def build_report(meta: dict[str, Any], results: list[ScenarioResult], registry: Mapping[str, Scenario],
                 floors: Floors | None = None) -> dict[str, Any]:
    """The whole report; `floors`, the lab's in-process probe, stands in for the server's own
    per-request timing where the server gave none."""
    scenarios = {r.name: scenario_dict(r, registry, floors or {}) for r in results}
    return {"toolkv_bench": REPORT_VERSION, **meta, "scenarios": scenarios}


def ran(registry: Mapping[str, Scenario], scenarios: Scenarios) -> list[Scenario]:
    """The registry's scenarios that ran and were not skipped, in the registry's order."""
    return [s for name, s in registry.items() if name in scenarios and not scenarios[name].get("skipped")]


def hooks(registry: Mapping[str, Scenario], scenarios: Scenarios, part: str) -> list[Any]:
    """Each distinct `part` hook (table, lines, plot) of the scenarios that ran, once (the
    concurrency table covers two scenarios)."""
    found: list[Any] = []
    for scenario in ran(registry, scenarios):
        hook = getattr(scenario, part)
        if hook is not None and hook not in found:
            found.append(hook)
    return found


SUMMARY_COLUMNS = ("scenario", "tools", "n", "miss", "hit", "bypass", "speedup", "floor", "overhead")
SUMMARY_CAPTION = ("p50 TTFT in ms (p95 in the JSON); n = misses/hits/bypasses (single: warm misses, the first "
                   "request on its own line); floor = the model's own suffix prefill on a hit; overhead = hit TTFT - "
                   "floor, per request")


def summary_rows(report: dict[str, Any], registry: Mapping[str, Scenario]) -> list[list[str]]:
    """The main table's rows (SUMMARY_COLUMNS): one per scenario timed by cache class, or per tool count."""
    out = []
    for name, scenario in report["scenarios"].items():
        if not registry[name].in_table:
            continue
        if scenario.get("skipped"):
            out.append([name, "", "skipped", *[""] * 6])
            continue
        rows = scenario["by_tools"].items() if "by_tools" in scenario else [("", scenario)]
        out += [[name, tools or _tools_of(scenario), *_cells(data)] for tools, data in rows]
    return out


def print_table(report: dict[str, Any], registry: Mapping[str, Scenario], console: Console) -> None:
    """The measurements: the tables, then a line per finding (no targets: those are the lab's)."""
    table = Table(title=f"toolkv bench: {report.get('model')} at {report.get('base_url')}", box=box.SIMPLE,
                  caption=SUMMARY_CAPTION)
    for column in SUMMARY_COLUMNS:
        table.add_column(column, justify="left" if column == "scenario" else "right", no_wrap=True)
    for row in summary_rows(report, registry):
        table.add_row(*row)
    if table.rows:
        console.print(table)
    for make in hooks(registry, report["scenarios"], "table"):
        if (own := make(report["scenarios"])) is not None:
            console.print(own)
    for line in summary_lines(report, registry):
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


def summary_lines(report: dict[str, Any], registry: Mapping[str, Scenario]) -> list[str]:
    """Each scenario's lines, forced tokens, skips and notes, the lab's lines (when it ran), memory."""
    s = report["scenarios"]
    lines = [line for make in hooks(registry, s, "lines") for line in make(s)]
    lines += forced_lines(s)
    for name, scenario in s.items():
        lines += [f"{name}: skipped, {scenario['skipped']}"] if scenario.get("skipped") else []
        lines += [f"{name}: {note}" for note in scenario.get("notes", [])]
    lab_lines: list[str] = report.get("lab_lines", [])
    return lines + lab_lines + memory_lines(report.get("memory"))


def interleaved_lines(s: Scenarios) -> list[str]:
    i = s["interleaved"]
    return [f"interleaved {i['order']}: {' '.join(i['sequence'])} -> every repeat hit: {i['every_repeat_hit']}"]


def single_lines(s: Scenarios) -> list[str]:
    """Decode of one stream at a time, and the first request against a later miss."""
    f, lines = s["single"], []
    if f["decode_ms_per_token"]["n"]:
        d, tokens = f["decode_ms_per_token"], f["output_tokens_p50"]
        lines.append(f"single: decode, one stream at a time: {num(d['p50'], 1)} ms/token p50 ({num(d['p95'], 1)} p95) "
                     f"over {d['n']} answers of {num(tokens)} tokens")
    if f.get("first_over_later_miss") is not None:
        after = "the first after the server started" if f["first_after_start"] else "the bench's first"
        lines.append(f"single: the first request ({after}, a miss) took {num(f['first_miss_ttft_ms'])} ms, "
                     f"{f['first_over_later_miss']}x a later miss of the same size"
                     + (f" (load average {f['first_load_average']} on {f['num_cpus']} cores)"
                        if f.get("first_load_average") is not None else ""))
    return lines


def restart_lines(s: Scenarios) -> list[str]:
    r = s["restart"]
    return [f"restart: first request after restart was a {r['first_after_restart']}, "
            f"{r['restart_speedup']}x faster than the miss before it (restart took {r['restart_s']} s)"]


def soak_lines(s: Scenarios) -> list[str]:
    k = s["soak"]
    shown = ", ".join(f"{r['rss_mb']:,.0f}" for r in k["rss_mb"] if r["rss_mb"] is not None)
    return [f"soak: {k['requests']:,} requests over {k['groups']} groups from {k['clients']} clients, "
            f"{k['errors']} errors; server RSS (MB) every 10%: {shown}; growth {num(k['rss_growth_mb'])} MB"]
