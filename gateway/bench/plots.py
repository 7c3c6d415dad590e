"""PNG plots of a bench report: TTFT against tool count (miss, hit, floor) and a request timeline.
Uses matplotlib's object API (no pyplot, so no global figure state and no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.ticker import MaxNLocator

COLORS = {"miss": "#d62728", "hit": "#2ca02c", "bypass": "#7f7f7f", "error": "#000000", "floor": "#1f77b4"}
SIZE_SCENARIOS = ("toolcount", "single")  # sequential requests on groups that start at tool 0


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    paths = [out_dir / "ttft_vs_tools.png", out_dir / "timeline.png"]
    _ttft_vs_tools(report, paths[0])
    _timeline(report, paths[1])
    return paths


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _ttft_by_size(report: dict[str, Any]) -> dict[str, dict[int, list[float]]]:
    """TTFT samples per class and tool count; the floor is the model's own suffix prefill that the
    server reported for each hit (Server-Timing), else the in-process probe's."""
    series: dict[str, dict[int, list[float]]] = {"miss": {}, "hit": {}, "bypass": {}, "floor": {}}
    for name in SIZE_SCENARIOS:
        for s in report["scenarios"].get(name, {}).get("samples", []):
            if s["cache"] in series and s["ttft_s"] is not None:
                series[s["cache"]].setdefault(s["num_tools"], []).append(s["ttft_s"] * 1000)
            prefill = (s.get("server_timing_ms") or {}).get("prefill")
            if s["cache"] == "hit" and prefill is not None:
                series["floor"].setdefault(s["num_tools"], []).append(prefill)
    if not series["floor"]:
        floors = report["floor"]["by_tools"]
        series["floor"] = {int(n): [f["floor_ms"]["p50"]] for n, f in floors.items() if f["floor_ms"]["p50"]}
    return series


def _ttft_vs_tools(report: dict[str, Any], path: Path) -> None:
    from gateway.bench.report import percentile

    fig = _figure(7, 4.5)
    ax = fig.add_subplot()
    series = _ttft_by_size(report)
    for cls, by_size in series.items():
        sizes = sorted(by_size)
        if not sizes:
            continue
        p50 = [percentile(by_size[n], 50) or 0.0 for n in sizes]
        p95 = [percentile(by_size[n], 95) or 0.0 for n in sizes]
        style = "--" if cls == "floor" else "-"
        ax.plot(sizes, p50, style, marker="o", color=COLORS[cls], label=f"{cls} p50")
        if cls != "floor":
            ax.fill_between(sizes, p50, p95, color=COLORS[cls], alpha=0.15)
    ax.set_yscale("log")
    _size_ticks(ax, report)
    ax.set_xlabel("tools in the group (prompt tokens)")
    ax.set_ylabel("time to first token (ms, log)")
    ax.set_title(f"TTFT against tool count: {report.get('model')}")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no samples", ha="center", transform=ax.transAxes)
    fig.savefig(path)


def _timeline(report: dict[str, Any], path: Path) -> None:
    samples = sorted((s for sc in report["scenarios"].values() for s in sc.get("samples", [])),
                     key=lambda s: s["started_s"])
    fig = _figure(10, max(3.0, 0.12 * len(samples) + 1.5))
    ax = fig.add_subplot()
    for row, s in enumerate(samples):
        ax.hlines(row, s["started_s"], s["started_s"] + s["total_s"], color=COLORS[s["cache"]], lw=1, alpha=0.6)
        if s["ttft_s"] is not None:
            ax.hlines(row, s["started_s"], s["started_s"] + s["ttft_s"], color=COLORS[s["cache"]], lw=4)
    _label_scenarios(ax, samples)
    for cls in ("miss", "hit", "bypass", "error"):
        ax.plot([], [], color=COLORS[cls], lw=4, label=cls)
    ax.invert_yaxis()
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("seconds since the start of the run (thick: to first token, thin: to last)")
    ax.set_ylabel("request")
    ax.set_title("request timeline")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.savefig(path)


def _size_ticks(ax: Any, report: dict[str, Any]) -> None:
    """One tick per tool count, labelled with its median prompt length."""
    from gateway.bench.report import percentile

    tokens: dict[int, list[int]] = {}
    for name in SIZE_SCENARIOS:
        for s in report["scenarios"].get(name, {}).get("samples", []):
            if s["prompt_tokens"]:
                tokens.setdefault(s["num_tools"], []).append(s["prompt_tokens"])
    sizes = sorted(tokens)
    if sizes:
        ax.set_xticks(sizes, [f"{n}\n({percentile(tokens[n], 50):,.0f})" for n in sizes])


def _label_scenarios(ax: Any, samples: list[dict[str, Any]]) -> None:
    first_row: dict[str, int] = {}
    for row, s in enumerate(samples):
        first_row.setdefault(s["scenario"], row)
    for name, row in first_row.items():
        ax.axhline(row - 0.5, color="#cccccc", lw=0.8)
        ax.annotate(name, (0, row - 0.5), xycoords=("axes fraction", "data"), fontsize=8, va="top",
                    xytext=(2, -2), textcoords="offset points")
