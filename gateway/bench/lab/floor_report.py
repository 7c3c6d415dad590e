"""The in-process floor in the report: its numbers per group size, which hit overhead the targets
use (the server's own per-request timing first), and its lines."""

from __future__ import annotations

from typing import Any

from gateway.bench.lab.floor import FLOOR_DISABLED, FLOOR_LOCAL, FLOOR_QUICK, FloorResult
from gateway.bench.stats import num, percentile, rounded

FLOOR_SHARES_CPU = "unreliable: shares the CPU with the server"


def floor_dict(floor: FloorResult, shares_cpu: bool = False) -> dict[str, Any]:
    """The in-process floor of one group size. Each pair's overhead is its HTTP hit's TTFT minus its
    floor; a pair whose floor took longer than the hit has none (`negative_pairs` counts them): the
    floor was slowed by other work, most often the server's own on the same cores (`shares_cpu`)."""
    def stats(values: tuple[float, ...]) -> dict[str, float | None]:
        return {"p50": rounded(percentile(values, 50), 1), "p95": rounded(percentile(values, 95), 1)}

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
                     f"bench's own process: restore + suffix prefill {num(f['floor_ms']['p50'], 1)} ms p50; "
                     f"paired HTTP hit {num(f['paired_http_hit_ttft_ms']['p50'], 1)} ms -> {overhead}")
    return lines
