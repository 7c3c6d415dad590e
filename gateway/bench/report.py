"""Numbers from samples: p50/p95 per class (miss, hit, bypass), speedup = miss p50 / hit p50,
the floor and a hit's overhead above it, the issue's targets; the JSON report and the table."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from gateway.bench.client import Sample
from gateway.bench.floor import FloorResult
from gateway.bench.scenarios import ScenarioResult

CLASSES = ("miss", "hit", "bypass")
REPORT_VERSION = 1
# From issue 7, for the default model and a 20-tool group.
TARGET_SPEEDUP = 15.0
TARGET_OVERHEAD_MS = 20.0
TARGET_RESTART_SPEEDUP = 10.0


def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def _spread(values_s: list[float]) -> dict[str, float | None]:
    return {"p50": _ms(percentile(values_s, 50)), "p95": _ms(percentile(values_s, 95))}


def class_stats(samples: list[Sample]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for cls in CLASSES:
        chosen = [s for s in samples if s.cache == cls]
        rates = [r for s in chosen if (r := s.decode_tokens_per_s) is not None]
        out[cls] = {"n": len(chosen),
                    "ttft_ms": _spread([s.ttft_s for s in chosen if s.ttft_s is not None]),
                    "total_ms": _spread([s.total_s for s in chosen]),
                    "decode_tokens_per_s_p50": _round(percentile(rates, 50), 2),
                    "cached_tokens_p50": _round(percentile([s.cached_tokens or 0 for s in chosen], 50), 0),
                    "prompt_tokens_p50": _round(percentile([s.prompt_tokens or 0 for s in chosen], 50), 0)}
    out["errors"] = {"n": sum(1 for s in samples if s.cache == "error"),
                     "messages": sorted({s.error for s in samples if s.error})[:5]}
    return out


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 2) if numerator and denominator else None


def block(samples: list[Sample], floors: dict[int, FloorResult]) -> dict[str, Any]:
    """Stats, speedups, floor and overhead for a set of samples of one group shape. The floor is
    the model's own suffix prefill as the server timed it for each hit (else the in-process probe's)."""
    stats = class_stats(samples)
    miss, hit, bypass = (stats[c]["ttft_ms"]["p50"] for c in CLASSES)
    out: dict[str, Any] = {"classes": stats, "speedup": _ratio(miss, hit), "speedup_vs_bypass": _ratio(bypass, hit)}
    timed = [s for s in samples if s.cache == "hit" and s.overhead_ms is not None]
    if timed:  # the server split each hit's time: overhead paired per request
        overheads = [s.overhead_ms for s in timed if s.overhead_ms is not None]
        out["floor_ms_p50"] = _round(percentile([s.model_prefill_ms or 0.0 for s in timed], 50), 1)
        out["hit_overhead_ms"] = _round(percentile(overheads, 50), 1)
        out["hit_overhead_ms_p95"] = _round(percentile(overheads, 95), 1)
        out["overhead_from"] = "server-timing"
        return out
    aligned = [s.ttft_s for s in samples if s.cache == "hit" and s.tool_offset == 0 and s.ttft_s is not None]
    sizes = {s.num_tools for s in samples}
    floor = floors.get(sizes.pop()) if len(sizes) == 1 else None  # a floor is per group size
    if floor is not None and aligned:
        floor_p50 = percentile(floor.floor_ms, 50)
        hit_p50 = _ms(percentile(aligned, 50))
        out["floor_ms_p50"] = _round(floor_p50, 1)
        out["hit_overhead_ms"] = _round(hit_p50 - floor_p50, 1) if hit_p50 is not None and floor_p50 else None
        out["overhead_from"] = "probe"
    return out


def scenario_dict(result: ScenarioResult, floors: dict[int, FloorResult]) -> dict[str, Any]:
    out: dict[str, Any] = {"skipped": result.skipped, "notes": result.notes, **result.details}
    if result.skipped:
        return out
    counts = sorted({s.num_tools for s in result.samples})
    if result.name == "toolcount":  # one block per size: a speedup across sizes means nothing
        out["by_tools"] = {str(n): block([s for s in result.samples if s.num_tools == n], floors) for n in counts}
    else:
        out.update(block(result.samples, floors))
    out["samples"] = [s.to_dict() for s in result.samples]
    return out


def floor_dict(floor: FloorResult) -> dict[str, Any]:
    def stats(values: tuple[float, ...]) -> dict[str, float | None]:
        return {"p50": _round(percentile(values, 50), 1), "p95": _round(percentile(values, 95), 1)}

    pairs = [(h, f) for h, f in zip(floor.http_ttft_ms, floor.floor_ms, strict=False) if h is not None]
    return {"group": floor.group, "num_tools": floor.num_tools, "prefix_tokens": floor.prefix_tokens,
            "suffix_tokens": floor.suffix_tokens, "compile_s": floor.compile_s, "n": len(floor.floor_ms),
            "floor_ms": stats(floor.floor_ms), "restore_ms": stats(floor.restore_ms),
            "prepare_ms": stats(floor.prepare_ms), "engine_hit_prefill_ms": stats(floor.engine_hit_ms),
            "paired_http_hit_ttft_ms": stats(tuple(h for h, _ in pairs)),
            "paired_overhead_ms": stats(tuple(h - f for h, f in pairs))}


def targets(scenarios: dict[str, dict[str, Any]], floors: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The issue's targets, checked where the run measured them (None: not measured). The overhead
    is paired per request when the server reports its own timing; else the probe's pairing (HTTP
    hit and in-process floor taken back to back), when the floor has it."""
    single, inter, restart = (scenarios.get(n, {}) for n in ("single", "interleaved", "restart"))
    speedup, overhead = single.get("speedup"), single.get("hit_overhead_ms")
    sizes = {str(s["num_tools"]) for s in single.get("samples", [])}
    paired = (floors or {}).get(sizes.pop(), {}) if len(sizes) == 1 else {}
    if single.get("overhead_from") != "server-timing" and paired.get("paired_overhead_ms", {}).get("p50") is not None:
        overhead = paired["paired_overhead_ms"]["p50"]
    restart_speedup = restart.get("restart_speedup") if restart.get("first_after_restart") == "hit" else None
    return {
        "hit_speedup_at_least_15x": None if speedup is None else speedup >= TARGET_SPEEDUP,
        "hit_overhead_under_20ms": None if overhead is None else overhead < TARGET_OVERHEAD_MS,
        "interleaved_every_repeat_hits": inter.get("every_repeat_hit"),
        "restart_at_least_10x_faster": (None if restart.get("skipped") or not restart else
                                        restart_speedup is not None and restart_speedup >= TARGET_RESTART_SPEEDUP),
    }


def build_report(meta: dict[str, Any], results: list[ScenarioResult], floors: dict[int, FloorResult],
                 floor_skipped: str | None) -> dict[str, Any]:
    scenarios = {r.name: scenario_dict(r, floors) for r in results}
    by_tools = {str(n): floor_dict(f) for n, f in sorted(floors.items())}
    return {"toolkv_bench": REPORT_VERSION, **meta, "scenarios": scenarios,
            "floor": {"skipped": floor_skipped, "by_tools": by_tools}, "targets": targets(scenarios, by_tools)}


def print_table(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"toolkv bench: {report.get('model')} at {report.get('base_url')}", box=box.SIMPLE,
                  caption="p50 TTFT in ms (p95 in the JSON); n = misses/hits/bypasses; floor = the model's own "
                          "suffix prefill on a hit; overhead = hit TTFT - floor, per request")
    for column in ("scenario", "tools", "n", "miss", "hit", "bypass", "speedup", "floor", "overhead"):
        table.add_column(column, justify="left" if column == "scenario" else "right", no_wrap=True)
    for name, scenario in report["scenarios"].items():
        if scenario.get("skipped"):
            table.add_row(name, "", "skipped", *[""] * 6)
            continue
        rows = scenario["by_tools"].items() if "by_tools" in scenario else [("", scenario)]
        for tools, data in rows:
            table.add_row(name, tools or _tools_of(scenario), *_cells(data))
    console.print(table)
    for line in _extra_lines(report):
        console.print(line)


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


def _extra_lines(report: dict[str, Any]) -> list[str]:
    s = report["scenarios"]
    lines = []
    if "interleaved" in s and not s["interleaved"].get("skipped"):
        i = s["interleaved"]
        sequence = " ".join(i["sequence"])
        lines.append(f"interleaved {i['order']}: {sequence} -> every repeat hit: {i['every_repeat_hit']}")
    if "restart" in s and not s["restart"].get("skipped"):
        r = s["restart"]
        lines.append(f"restart: first request after restart was a {r['first_after_restart']}, "
                     f"{r['restart_speedup']}x faster than the miss before it (restart took {r['restart_s']} s)")
    if "concurrent" in s and not s["concurrent"].get("skipped"):
        c = s["concurrent"]
        lines.append(f"concurrent: {c['clients']} clients x {c['requests_per_client']} requests in {c['wall_s']} s "
                     f"({c['requests_per_s']} req/s, {c['completion_tokens_per_s']} completion tokens/s)")
    for name, scenario in s.items():
        lines += [f"{name}: skipped, {scenario['skipped']}"] if scenario.get("skipped") else []
        lines += [f"{name}: {note}" for note in scenario.get("notes", [])]
    if report["floor"]["skipped"]:
        lines.append(f"floor: skipped ({report['floor']['skipped']})")
    for tools, f in report["floor"]["by_tools"].items():
        lines.append(f"cross-check, the floor in the bench's own process, {tools} tools ({f['prefix_tokens']} + "
                     f"{f['suffix_tokens']} tokens): restore + suffix prefill {f['floor_ms']['p50']} ms "
                     f"(restore {f['restore_ms']['p50']}); "
                     f"engine hit prefill {f['engine_hit_prefill_ms']['p50']}; prepare {f['prepare_ms']['p50']}; "
                     f"paired HTTP hit TTFT {f['paired_http_hit_ttft_ms']['p50']} -> overhead "
                     f"{f['paired_overhead_ms']['p50']} ms (p50)")
    lines.append("targets: " + ", ".join(f"{k}={v}" for k, v in report["targets"].items()))
    return lines
