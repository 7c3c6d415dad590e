"""PNG plots of a bench report: TTFT against tool count (miss, hit, floor), a request timeline,
(when the concurrent or compile-overlap scenario ran) concurrency: output tokens/s and hit TTFT
against clients, and hit TTFT alone vs during another group's compile; and (when the agent
scenario ran) per turn of each conversation: cached, computed and new tokens, and TTFT; (when the
lab's history scenario ran) its own plot.
Uses matplotlib's object API (no pyplot, so no global figure state and no display needed)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gateway.bench.context import Scenario
from gateway.bench.report import hooks
from gateway.bench.stats import percentile

COLORS = {"miss": "#d62728", "hit": "#2ca02c", "bypass": "#7f7f7f", "error": "#000000", "floor": "#1f77b4"}
MODE_COLORS = {"one-group": "#2ca02c", "mixed-groups": "#9467bd"}
SIZE_SCENARIOS = ("toolcount", "single")  # sequential requests on groups that start at tool 0


def write_plots(report: dict[str, Any], out_dir: Path, registry: Mapping[str, Scenario]) -> list[Path]:
    """The bench's own plots, then each scenario's `plot` (the lab's history)."""
    paths = [out_dir / "ttft_vs_tools.png", out_dir / "timeline.png"]
    _ttft_vs_tools(report, paths[0])
    _timeline(report, paths[1])
    ran = [n for n in ("concurrent", "compile-overlap") if n in report["scenarios"]
           and not report["scenarios"][n].get("skipped")]
    if ran:
        paths.append(out_dir / "concurrency.png")
        _concurrency(report, paths[-1])
    agent = report["scenarios"].get("agent")
    if agent and not agent.get("skipped"):
        paths.append(out_dir / "agent.png")
        _agent(agent, report.get("model"), paths[-1])
    for plot in hooks(registry, report["scenarios"], "plot"):
        if (written := plot(report["scenarios"], report.get("model"), out_dir)) is not None:
            paths.append(written)
    return paths


def figure(width: float, height: float) -> Any:
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
        floors = report.get("floor", {}).get("by_tools", {})  # the lab's in-process probe
        series["floor"] = {int(n): [f["floor_ms"]["p50"]] for n, f in floors.items() if f["floor_ms"]["p50"]}
    return series


def _ttft_vs_tools(report: dict[str, Any], path: Path) -> None:
    fig = figure(7, 4.5)
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
    fig = figure(10, max(3.0, 0.12 * len(samples) + 1.5))
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


def _concurrency(report: dict[str, Any], path: Path) -> None:
    """Three panels: aggregate output tokens/s against clients, hit TTFT p50 (p95 dashed) against
    clients, one line per mode; hit TTFT alone, during a compile, and the compile's own TTFT."""
    fig = figure(14, 4.5)
    tokens_ax, ttft_ax, overlap_ax = fig.subplots(1, 3)
    concurrent = report["scenarios"].get("concurrent", {})
    cases = [] if concurrent.get("skipped") else concurrent.get("cases", [])
    for mode in MODE_COLORS:
        own = sorted((c for c in cases if c["mode"] == mode), key=lambda c: c["clients"])
        if not own:
            continue
        clients = [c["clients"] for c in own]
        tokens_ax.plot(clients, [c["tokens_per_s"] or 0.0 for c in own], "-", marker="o", color=MODE_COLORS[mode],
                       label=mode)
        ttft_ax.plot(clients, [c["hit_ttft_ms"]["p50"] or 0.0 for c in own], "-", marker="o",
                     color=MODE_COLORS[mode], label=f"{mode} p50")
        ttft_ax.plot(clients, [c["hit_ttft_ms"]["p95"] or 0.0 for c in own], "--", marker=".",
                     color=MODE_COLORS[mode], alpha=0.6, label=f"{mode} p95")
    for ax, title, ylabel in ((tokens_ax, "aggregate output tokens/s", "output tokens / s (all clients)"),
                              (ttft_ax, "hit TTFT", "time to first token (ms)")):
        ax.set_title(title)
        ax.set_xlabel("streaming clients at once")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "concurrent not run", ha="center", transform=ax.transAxes)
    _overlap_bars(report["scenarios"].get("compile-overlap", {}), overlap_ax)
    fig.suptitle(f"concurrency: {report.get('model')}")
    fig.savefig(path)


def _overlap_bars(overlap: dict[str, Any], ax: Any) -> None:
    ax.set_title("hits while another group compiles")
    ax.set_ylabel("time to first token, p50 (ms, log)")
    if not overlap or overlap.get("skipped"):
        ax.text(0.5, 0.5, "compile-overlap not run", ha="center", transform=ax.transAxes)
        return
    labels = ["hit alone", "hit during\ncompile", "the compile\n(a miss)"]
    values = [overlap["hit_alone"]["ttft_ms"]["p50"], overlap["hit_during_compile"]["ttft_ms"]["p50"],
              overlap["compile_ttft_ms"]]
    bars = ax.bar(labels, [v or 0.0 for v in values], color=[COLORS["hit"], "#ff7f0e", COLORS["miss"]])
    if all(values):
        ax.set_yscale("log")  # the compile is seconds, a hit a few hundred ms
        ax.set_ylim(bottom=min(v for v in values if v) / 2)
    ax.bar_label(bars, labels=["-" if v is None else f"{v:,.0f}" for v in values], fontsize=8)
    ratio = overlap.get("during_over_alone")
    if ratio is not None:
        ax.annotate(f"during / alone = {ratio:.2f}x", (0.02, 0.95), xycoords="axes fraction", va="top", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)


def _agent(agent: dict[str, Any], model: str | None, path: Path) -> None:
    """Per turn, in the order sent: prompt tokens split into cached and computed; computed tokens
    beside the new messages' tokens (a server that reuses the conversation computes about as many);
    TTFT. Conversations are separated by vertical lines."""
    rows = agent["turns"]
    fig = figure(max(7.0, 0.35 * len(rows) + 3.5), 9)
    prompt_ax, computed_ax, ttft_ax = fig.subplots(3, 1, sharex=True)
    x = list(range(len(rows)))
    cached = [r["cached_tokens"] or 0 for r in rows]
    computed = [r["computed_tokens"] if r["computed_tokens"] is not None else (r["prompt_tokens"] or 0) for r in rows]
    prompt_ax.bar(x, cached, color=COLORS["hit"], label="cached")
    prompt_ax.bar(x, computed, bottom=cached, color=COLORS["miss"], label="computed")
    prompt_ax.set_ylabel("prompt tokens")
    computed_ax.bar([i - 0.2 for i in x], computed, width=0.4, color=COLORS["miss"], label="computed")
    computed_ax.bar([i + 0.2 for i in x], [r["new_tokens"] or 0 for r in rows], width=0.4, color="#7f7f7f",
                    label="new since the conversation's\nprevious turn (prompt delta)")
    computed_ax.set_ylabel("tokens")
    ttft_ax.bar(x, [r["ttft_ms"] or 0.0 for r in rows],
                color=[COLORS["error"] if r["error"] else COLORS["floor"] for r in rows], label="TTFT")
    ttft_ax.set_ylabel("time to first token (ms)")
    ttft_ax.set_xlabel("turn (the file's turn_index), in the order sent")
    for ax in (prompt_ax, computed_ax, ttft_ax):
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        _conversation_bounds(ax, rows, labelled=ax is prompt_ax)
    if len(rows) <= 60:
        ttft_ax.set_xticks(x, [str(r["turn"]) for r in rows], fontsize=7)
    fig.suptitle(f"agent: tau-bench conversations turn by turn: {model}")
    fig.savefig(path)


def _conversation_bounds(ax: Any, rows: list[dict[str, Any]], *, labelled: bool) -> None:
    for i, row in enumerate(rows):
        if row["first_turn"] and i > 0:
            ax.axvline(i - 0.5, color="#888888", lw=0.8)
        if row["first_turn"] and labelled:
            ax.annotate(row["conversation"], (i - 0.4, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                        va="bottom", xytext=(0, 2), textcoords="offset points")
