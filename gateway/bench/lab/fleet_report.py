"""The fleet scenario's numbers: for the interleaved part and the round-robin baseline, the hit
rate after each group's first request and the compiles per group and per replica; for the hot
group and the balanced case, requests per replica and hit TTFT, and their ratio; the table and
the summary lines (its targets are in lab/targets.py)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich import box
from rich.table import Table

from gateway.bench.client import Sample
from gateway.bench.stats import ttft_stats


def fleet_stats(samples: list[Sample], details: dict[str, Any]) -> dict[str, Any]:
    replicas = details["replicas"]
    out: dict[str, Any] = {"interleaved": sequence_stats(_part(samples, "interleaved"), replicas),
                           "errors": sum(1 for s in samples if s.cache == "error")}
    for name in ("hot", "balanced"):
        out[name] = {**details[name], **_measured(_part(samples, name))}
    hot = details["hot"]
    out["hot"]["replicas_reached"] = sorted({*hot["warm"]["requests"], *hot["measure"]["requests"]})
    out["hot_over_balanced_p95"] = _ratio(out["hot"]["hit_ttft_ms"]["p95"], out["balanced"]["hit_ttft_ms"]["p95"])
    out["balanced"]["warm_routed_to"] = {s.group: s.tags["routed_to"] for s in _part(samples, "balanced")
                                         if s.tags.get("phase") == "warm"}
    base = details["baseline"]
    baseline_samples = _part(samples, "baseline")
    out["baseline"] = {**base, **sequence_stats(baseline_samples, base.get("replicas", replicas))} \
        if baseline_samples else base
    return out


def _part(samples: list[Sample], part: str) -> list[Sample]:
    return [s for s in samples if s.tags["part"] == part]


def sequence_stats(samples: list[Sample], replicas: list[str]) -> dict[str, Any]:
    """One request at a time: hits after each group's first, and who compiled what."""
    after_first = [s for s in samples if s.tags["round"] > 0]
    hits = sum(1 for s in after_first if s.cache == "hit")
    known = all(s.tags.get("compiled_on") is not None for s in samples)
    groups = {label: _group_stats([s for s in samples if s.group == label], known)
              for label in dict.fromkeys(s.group for s in samples)}
    compiled = Counter(r for s in samples for r in s.tags.get("compiled_on") or ())
    return {
        "requests": len(samples), "misses": sum(1 for s in samples if s.cache == "miss"),
        "errors": sum(1 for s in samples if s.cache == "error"),
        "after_first": {"n": len(after_first), "hits": hits, "hit_rate": _share(hits, len(after_first))},
        "routed": dict(sorted(Counter(r for s in samples for r in s.tags["routed_to"]).items())),
        "compiles": {r: compiled.get(r, 0) for r in sorted({*replicas, *compiled})} if known else None,
        "groups_compiled_once": sum(1 for g in groups.values() if g["compiled_once"]) if known else None,
        "groups_compiled_on_several": (sum(1 for g in groups.values() if len(g["compiles"] or {}) > 1)
                                       if known else None),
        "by_group": groups, "order": "".join(s.group.removeprefix("RR-") for s in samples),
        "sequence": [s.cache for s in samples],
        "hit_ttft_ms": ttft_stats([s for s in samples if s.cache == "hit"]),
        "miss_ttft_ms": ttft_stats([s for s in samples if s.cache == "miss"]),
    }


def _group_stats(own: list[Sample], known: bool) -> dict[str, Any]:
    compiles = Counter(r for s in own for r in s.tags.get("compiled_on") or ())
    first = own[0].tags.get("compiled_on")
    return {"routed": dict(sorted(Counter(r for s in own for r in s.tags["routed_to"]).items())),
            "compiles": dict(sorted(compiles.items())) if known else None,
            "first_compiled_on": first,
            "compiled_once": known and first is not None and len(first) == 1 and sum(compiles.values()) == 1,
            "sequence": [s.cache for s in own]}


def _measured(samples: list[Sample]) -> dict[str, Any]:
    measured = [s for s in samples if s.tags.get("phase") == "measure"]
    return {"n": len(measured), "hits": sum(1 for s in measured if s.cache == "hit"),
            "misses": sum(1 for s in measured if s.cache == "miss"),
            "errors": sum(1 for s in measured if s.cache == "error"),
            "hit_ttft_ms": ttft_stats([s for s in measured if s.cache == "hit"])}


def fleet_table(f: dict[str, Any]) -> Table:
    names = f["replicas"]
    table = Table(title=f"fleet: {len(names)} replicas behind one ingress", box=box.SIMPLE, padding=(0, 1, 0, 0),
                  caption=f"after 1st: hits among the requests after each group's first; requests and compiles per "
                          f"replica ({'/'.join(names)}) from the ingress's /metrics; TTFT in ms")
    for column in ("part", "n", "after 1st", "requests", "compiles", "hit p50", "hit p95", "miss p50"):
        table.add_column(column, justify="left" if column == "part" else "right", no_wrap=True)
    for label, key in (("interleaved", "interleaved"), ("round robin", "baseline")):
        part = f[key]
        if part.get("skipped") or "requests" not in part:
            table.add_row(label, "skipped", *[""] * 6)
            continue
        table.add_row(label, str(part["requests"]), _pct(part["after_first"]["hit_rate"]), _per(part["routed"], names),
                      _per(part["compiles"], names), _num(part["hit_ttft_ms"]["p50"]),
                      _num(part["hit_ttft_ms"]["p95"]), _num(part["miss_ttft_ms"]["p50"]))
    for label in ("hot", "balanced"):
        part = f[label]
        table.add_row(label, f"{part['hits']}/{part['n']}", "-", _per(part["measure"]["requests"], names),
                      _per(part["measure"]["compiles"], names), _num(part["hit_ttft_ms"]["p50"]),
                      _num(part["hit_ttft_ms"]["p95"]), "-")
    return table


def fleet_lines(f: dict[str, Any]) -> list[str]:
    inter, hot = f["interleaved"], f["hot"]
    lines = [f"fleet interleaved ({f['groups']} groups x {f['rounds']} rounds, {len(f['replicas'])} replicas): "
             f"{inter['after_first']['hits']}/{inter['after_first']['n']} requests after a group's first hit "
             f"({_pct(inter['after_first']['hit_rate'])}); groups compiled once, on one replica: "
             f"{_num(inter['groups_compiled_once'])} of {len(inter['by_group'])}; compiles per replica "
             f"{_pairs(inter['compiles'])}"]
    base = f["baseline"]
    if base.get("skipped"):
        lines.append(f"fleet baseline: skipped, {base['skipped']}")
    elif "requests" in base:
        lines.append(f"fleet baseline ({base['fleet']}; routes {_pairs(base.get('routes'))}): "
                     f"{base['after_first']['hits']}/{base['after_first']['n']} after a group's first hit "
                     f"({_pct(base['after_first']['hit_rate'])}); compiles per replica {_pairs(base['compiles'])}, "
                     f"groups compiled on several replicas: {_num(base['groups_compiled_on_several'])}")
    if "requests" in base and "turn" not in base.get("routes", {}):
        lines.append("fleet: the baseline fleet did not route round robin (start it with --upstream-routing "
                     "round_robin --replica-cache separate)")
    lines.append(f"fleet hot group, {f['clients']} clients x {f['requests_per_client']} requests: requests per replica "
                 f"{_pairs(hot['measure']['requests'])} (routes {_pairs(hot['measure']['routes'])}; warming round "
                 f"{_pairs(hot['warm']['requests'])}); hit TTFT p95 {_num(hot['hit_ttft_ms']['p95'])} ms vs balanced "
                 f"{_num(f['balanced']['hit_ttft_ms']['p95'])} ms = {_times(f['hot_over_balanced_p95'])}")
    if hot["measure"]["routes"].get("spill", 0) == 0 and hot["warm"]["routes"].get("spill", 0) == 0:
        lines.append("fleet: the hot group never spilled: the ingress's upstream_max_in_flight is above the clients "
                     "in flight on its home (--spawn sets it to half the clients)")
    balanced = f["balanced"]
    moved = [g for g, home in balanced["homes"].items() if balanced["warm_routed_to"].get(g) != [home]]
    if moved:
        lines.append(f"fleet: balanced groups routed elsewhere than their predicted homes: {', '.join(moved)} "
                     "(API keys or shared_groups the bench does not know of)")
    return lines


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 2) if numerator and denominator else None


def _share(count: int, total: int) -> float | None:
    return round(count / total, 4) if total else None


def _per(counts: dict[str, int] | None, names: list[str]) -> str:
    return "-" if counts is None else "/".join(str(counts.get(n, 0)) for n in names)


def _pairs(counts: dict[str, int] | None) -> str:
    return "-" if counts is None else (", ".join(f"{k} {v}" for k, v in counts.items()) or "none")


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
