"""Numbers from samples: p50/p95 per class (miss, hit, bypass), speedup = miss p50 / hit p50,
the floor and a hit's overhead above it; per concurrency case hit TTFT and aggregate output
tokens/s, and the ratios against one client and against hits alone; the agent scenario's rows (in
agent_report), the history scenario's (in history_report), the constrained scenario's (in
constrained_report) and the fleet scenario's (in fleet_report); the issues' targets; the JSON report
and the tables."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from gateway.bench.agent_report import agent_lines, agent_stats, agent_table, agent_target
from gateway.bench.client import Sample
from gateway.bench.constrained_report import (
    constrained_lines,
    constrained_stats,
    constrained_table,
    constrained_targets,
)
from gateway.bench.context import ScenarioResult
from gateway.bench.fleet_report import fleet_lines, fleet_stats, fleet_table, fleet_targets
from gateway.bench.floor import FLOOR_DISABLED, FLOOR_LOCAL, FLOOR_QUICK, FloorResult
from gateway.bench.history_report import history_lines, history_stats, history_target
from gateway.bench.hostile import hostile_lines, hostile_targets
from gateway.bench.stats import ms_spread, percentile, to_ms, ttft_stats

CLASSES = ("miss", "hit", "bypass")
REPORT_VERSION = 1
# From issue 7, for the default model and a 20-tool group.
TARGET_SPEEDUP = 15.0
TARGET_OVERHEAD_MS = 20.0
TARGET_RESTART_SPEEDUP = 10.0
# From issue 13 (concurrency), one group: 4 clients' output tokens/s over 1 client's, their hit
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
        hit_p50 = to_ms(percentile(aligned, 50))
        out["floor_ms_p50"] = _round(floor_p50, 1)
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
    elif result.name == "fleet":  # about routing: per part, replica and group
        out.update(fleet_stats(result.samples, result.details))
    elif result.name == "soak":  # about memory: the samples' timings are in `samples`
        out["errors"] = sum(1 for s in result.samples if s.cache == "error")
    else:
        out.update(block(result.samples, floors))
    out["samples"] = [s.to_dict() for s in result.samples]
    return out


def case_stats(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    """One concurrency case: hit TTFT p50/p95 and aggregate output tokens/s over the case's wall
    time. Tokens are the server's `completion_tokens` (the final usage chunk); a server that sends
    no usage is counted by content chunks and says so in `tokens_from`."""
    hits = [s for s in samples if s.cache == "hit"]
    usage = all(s.completion_tokens is not None for s in samples if s.cache != "error")
    tokens = sum((s.completion_tokens or 0) if usage else s.token_chunks for s in samples)
    rates = [r for s in hits if (r := s.decode_tokens_per_s) is not None]
    return {"n": len(samples), "hits": len(hits), "misses": sum(1 for s in samples if s.cache == "miss"),
            "errors": sum(1 for s in samples if s.cache == "error"),
            "hit_ttft_ms": ttft_stats(hits), "total_ms": ms_spread([s.total_s for s in samples]),
            "completion_tokens": tokens, "tokens_from": "usage" if usage else "chunks",
            "tokens_per_s": _round(tokens / wall_s, 2) if wall_s > 0 else None,
            "requests_per_s": _round(len(samples) / wall_s, 3) if wall_s > 0 else None,
            "decode_tokens_per_s_per_request_p50": _round(percentile(rates, 50), 2)}


def concurrent_stats(samples: list[Sample], cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Each case's numbers, each against the same mode's smallest client count (1 by default), and
    the issue's ratios at 4 clients over 1 per mode."""
    enriched = []
    for case in cases:
        measured = [s for s in samples if s.tags.get("case") == case["case"] and s.tags.get("phase") == "measure"]
        enriched.append({**case, **case_stats(measured, case["wall_s"])})
    ratios: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(c["mode"] for c in enriched):  # in the order they ran
        own = sorted((c for c in enriched if c["mode"] == mode), key=lambda c: c["clients"])
        base = own[0]
        for c in own:
            c["tokens_per_s_vs_base"] = _ratio(c["tokens_per_s"], base["tokens_per_s"])
            c["hit_ttft_p50_vs_base"] = _ratio(c["hit_ttft_ms"]["p50"], base["hit_ttft_ms"]["p50"])
            c["base_clients"] = base["clients"]
        by_clients = {c["clients"]: c for c in own}
        one, four = by_clients.get(1), by_clients.get(4)
        ratios[mode] = {
            "tokens_per_s_4_over_1": _ratio(four["tokens_per_s"], one["tokens_per_s"]) if one and four else None,
            "hit_ttft_p50_4_over_1": (_ratio(four["hit_ttft_ms"]["p50"], one["hit_ttft_ms"]["p50"])
                                      if one and four else None)}
    return {"cases": enriched, "ratios": ratios,
            "misses_measured": sum(c["misses"] for c in enriched), "errors": sum(c["errors"] for c in enriched)}


def overlap_stats(samples: list[Sample]) -> dict[str, Any]:
    """Hit TTFT alone and while the other group compiled, and their ratio (p50 over p50)."""
    alone = [s for s in samples if s.tags.get("phase") == "alone" and s.cache == "hit"]
    during = [s for s in samples if s.tags.get("phase") == "during-compile" and s.tags.get("overlapped")
              and s.cache == "hit"]
    alone_ttft, during_ttft = ttft_stats(alone), ttft_stats(during)
    return {"hit_alone": {"n": len(alone), "ttft_ms": alone_ttft},
            "hit_during_compile": {"n": len(during), "ttft_ms": during_ttft},
            "during_over_alone": _ratio(during_ttft["p50"], alone_ttft["p50"]),
            "during_over_alone_p95": _ratio(during_ttft["p95"], alone_ttft["p95"]),
            "errors": sum(1 for s in samples if s.cache == "error")}


def floor_dict(floor: FloorResult, shares_cpu: bool = False) -> dict[str, Any]:
    """The in-process floor of one group size. Each pair's overhead is its HTTP hit's TTFT minus its
    floor; a pair whose floor took longer than the hit has none (`negative_pairs` counts them): the
    floor was slowed by other work, most often the server's own on the same cores (`shares_cpu`)."""
    def stats(values: tuple[float, ...]) -> dict[str, float | None]:
        return {"p50": _round(percentile(values, 50), 1), "p95": _round(percentile(values, 95), 1)}

    pairs = [(h, f) for h, f in zip(floor.http_ttft_ms, floor.floor_ms, strict=False) if h is not None]
    overheads = tuple(h - f for h, f in pairs if h >= f)
    return {"group": floor.group, "num_tools": floor.num_tools, "prefix_tokens": floor.prefix_tokens,
            "suffix_tokens": floor.suffix_tokens, "compile_s": floor.compile_s, "n": len(floor.floor_ms),
            "shares_cpu": shares_cpu, "floor_ms": stats(floor.floor_ms), "restore_ms": stats(floor.restore_ms),
            "prepare_ms": stats(floor.prepare_ms), "engine_hit_prefill_ms": stats(floor.engine_hit_ms),
            "paired_http_hit_ttft_ms": stats(tuple(h for h, _ in pairs)),
            "paired_overhead_ms": stats(overheads), "negative_pairs": len(pairs) - len(overheads)}


def hit_overhead(scenarios: dict[str, dict[str, Any]], floors: dict[str, dict[str, Any]] | None) -> float | None:
    """The single scenario's hit overhead p50: paired per request when the server reports its own
    timing; else the probe's pairing (HTTP hit and in-process floor taken back to back) when the
    floor has one and did not share the server's cores; else hit p50 - floor p50."""
    single = scenarios.get("single", {})
    overhead: float | None = single.get("hit_overhead_ms")
    sizes = {str(s["num_tools"]) for s in single.get("samples", [])}
    paired = (floors or {}).get(sizes.pop(), {}) if len(sizes) == 1 else {}
    if (single.get("overhead_from") != "server-timing" and not paired.get("shares_cpu")
            and paired.get("paired_overhead_ms", {}).get("p50") is not None):
        overhead = paired["paired_overhead_ms"]["p50"]
    return overhead


def targets(scenarios: dict[str, dict[str, Any]], floors: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The issues' targets, checked where the run measured them (None: not measured); the overhead
    as `hit_overhead` picks it. Printed only with `--check` (checks.py)."""
    single, inter, restart = (scenarios.get(n, {}) for n in ("single", "interleaved", "restart"))
    speedup, overhead = single.get("speedup"), hit_overhead(scenarios, floors)
    restart_speedup = restart.get("restart_speedup") if restart.get("first_after_restart") == "hit" else None
    one_group = scenarios.get("concurrent", {}).get("ratios", {}).get("one-group", {})
    scaling, ttft_ratio = one_group.get("tokens_per_s_4_over_1"), one_group.get("hit_ttft_p50_4_over_1")
    overlap = scenarios.get("compile-overlap", {}).get("during_over_alone")
    soak = scenarios.get("soak", {})
    growth, first = soak.get("rss_growth_mb"), soak.get("rss_first_mb")
    return {
        "hit_speedup_at_least_15x": None if speedup is None else speedup >= TARGET_SPEEDUP,
        "hit_overhead_under_20ms": None if overhead is None else overhead < TARGET_OVERHEAD_MS,
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


FLOOR_SHARES_CPU = "unreliable: shares the CPU with the server"


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


SUMMARY_COLUMNS = ("scenario", "tools", "n", "miss", "hit", "bypass", "speedup", "floor", "overhead")
SUMMARY_CAPTION = ("p50 TTFT in ms (p95 in the JSON); n = misses/hits/bypasses; floor = the model's own suffix "
                   "prefill on a hit; overhead = hit TTFT - floor, per request")


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
    for line in summary_lines(report):
        console.print(line, highlight=False)


CONCURRENCY_SCENARIOS = ("concurrent", "compile-overlap")
# Reported on lines of their own, not in the main table.
OWN_LINE_SCENARIOS = (*CONCURRENCY_SCENARIOS, "soak", "agent", "history", "constrained", "fleet", "hostile-soak")


def concurrency_table(report: dict[str, Any]) -> Table | None:
    """One row per concurrency case and per compile-overlap phase; None when neither ran."""
    ran = {n: s for n in CONCURRENCY_SCENARIOS if (s := report["scenarios"].get(n)) and not s.get("skipped")}
    if not ran:
        return None
    table = Table(title="concurrency: streaming clients at once", box=box.SIMPLE, padding=(0, 1, 0, 0),
                  caption="hit TTFT p50/p95 in ms; n = hits/requests; tok/s = all clients' output tokens / the "
                          "case's wall time; x1 = over the same mode with the fewest clients (1 by default); "
                          "hit+compile: hits sent while another group's prefix compiled, x1 = over hits alone")
    for column in ("case", "clients", "groups", "n", "p50", "p95", "tok/s", "tok/s\nx1", "p50\nx1"):
        table.add_column(column, justify="left" if column == "case" else "right", no_wrap=True)
    for c in ran.get("concurrent", {}).get("cases", []):
        table.add_row(c["mode"], str(c["clients"]), str(c["groups"]), f"{c['hits']}/{c['n']}",
                      _num(c["hit_ttft_ms"]["p50"]), _num(c["hit_ttft_ms"]["p95"]), _num(c["tokens_per_s"], 1),
                      _times(c["tokens_per_s_vs_base"]), _times(c["hit_ttft_p50_vs_base"]))
    if "compile-overlap" in ran:
        o = ran["compile-overlap"]
        for label, part, ratio in (("hit alone", o["hit_alone"], None),
                                   ("hit+compile", o["hit_during_compile"], o["during_over_alone"])):
            table.add_row(label, "1", "1", str(part["n"]), _num(part["ttft_ms"]["p50"]), _num(part["ttft_ms"]["p95"]),
                          "-", "-", _times(ratio))
        table.add_row("compile", "", "", o["compile_cache"], _num(o["compile_ttft_ms"]), "", "", "", "")
    return table


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


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
    if "restart" in s and not s["restart"].get("skipped"):
        r = s["restart"]
        lines.append(f"restart: first request after restart was a {r['first_after_restart']}, "
                     f"{r['restart_speedup']}x faster than the miss before it (restart took {r['restart_s']} s)")
    if "concurrent" in s and not s["concurrent"].get("skipped"):
        for mode, r in s["concurrent"]["ratios"].items():
            if r["tokens_per_s_4_over_1"] is None and r["hit_ttft_p50_4_over_1"] is None:
                continue
            lines.append(f"concurrent, {mode}: output tokens/s at 4 clients / 1 client = "
                         f"{_times(r['tokens_per_s_4_over_1'])}; "
                         f"hit TTFT p50 at 4 clients / 1 client = {_times(r['hit_ttft_p50_4_over_1'])}")
    if "compile-overlap" in s and not s["compile-overlap"].get("skipped"):
        o = s["compile-overlap"]
        lines.append(f"compile-overlap: hit TTFT p50 during a compile / alone = {_times(o['during_over_alone'])}; "
                     f"the compile ({o['compile_group_tools']} tools, "
                     f"{_num(o['compile_prompt_tokens'])} prompt tokens, a {o['compile_cache']}): TTFT "
                     f"{_num(o['compile_ttft_ms'])} ms"
                     + (f", server compile {o['compile_server_ms']:,.0f} ms" if o.get("compile_server_ms") else ""))
    if "soak" in s and not s["soak"].get("skipped"):
        k = s["soak"]
        shown = ", ".join(f"{r['rss_mb']:,.0f}" for r in k["rss_mb"] if r["rss_mb"] is not None)
        lines.append(f"soak: {k['requests']:,} requests over {k['groups']} groups from {k['clients']} clients, "
                     f"{k['errors']} errors; server RSS (MB) every 10%: {shown}; growth "
                     f"{_num(k['rss_growth_mb'])} MB")
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
    for name, scenario in s.items():
        lines += [f"{name}: skipped, {scenario['skipped']}"] if scenario.get("skipped") else []
        lines += [f"{name}: {note}" for note in scenario.get("notes", [])]
    lines += floor_lines(report["floor"])
    return lines


def floor_lines(floor: dict[str, Any]) -> list[str]:
    """The in-process floor, when it ran: a cross-check of the server's own per-request timing."""
    label = f" ({floor['note']})" if floor.get("note") else ""
    skipped = floor.get("skipped")
    lines = [f"floor: {skipped}"] if skipped and skipped not in (FLOOR_DISABLED, FLOOR_LOCAL, FLOOR_QUICK) else []
    for tools, f in floor["by_tools"].items():
        paired = f["paired_overhead_ms"]["p50"]
        overhead = (f"overhead {paired:+.1f} ms" if paired is not None else
                    "no overhead: the floor took longer than the hits it was paired with")
        lines.append(f"floor{label}, {tools} tools ({f['prefix_tokens']:,} + {f['suffix_tokens']:,} tokens) in the "
                     f"bench's own process: restore + suffix prefill {_num(f['floor_ms']['p50'], 1)} ms p50; "
                     f"paired HTTP hit {_num(f['paired_http_hit_ttft_ms']['p50'], 1)} ms -> {overhead}")
    return lines
