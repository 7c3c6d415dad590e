"""The history scenario's numbers: errors, how many later turns found their conversation's record
still in the pool, RSS growth over the run, the summary lines and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.ticker import MaxNLocator

from gateway.bench.client import Sample
from gateway.bench.plots import COLORS, figure


def history_stats(samples: list[Sample]) -> dict[str, Any]:
    """Errors, and the later turns (turn 2 on) split by whether they reused their conversation's
    record: cached tokens beyond the tool group's (what a first turn gets) mean the record was there."""
    answered = [s for s in samples if s.error is None]
    group = max((s.cached_tokens or 0 for s in answered if s.tags["turn"] == 1), default=0)
    later = [s for s in answered if s.tags["turn"] > 1 and s.cached_tokens is not None]
    found = sum(1 for s in later if (s.cached_tokens or 0) > group)
    prompt = sum(s.prompt_tokens or 0 for s in answered)
    cached = sum(s.cached_tokens or 0 for s in answered)
    return {"errors": sum(1 for s in samples if s.error is not None),
            "errors_first": sorted({s.error for s in samples if s.error})[:5],
            "group_tokens": group, "prompt_tokens": prompt, "cached_tokens": cached,
            "computed_tokens": prompt - cached,
            "later_turns": {"n": len(later), "record_found": found, "record_gone": len(later) - found}}


def history_lines(h: dict[str, Any]) -> list[str]:
    pool = h["pool"]
    size = (f"KV pool {_n(pool['tokens'])} tokens" + (f" = {pool['bytes'] / 1e6:,.1f} MB" if pool["bytes"] else "")
            if pool["tokens"] else "KV pool size unknown")
    cycled = f" ({h['computed_tokens'] / pool['tokens']:,.0f}x the pool)" if pool["tokens"] else ""
    shown = ", ".join(_n(r["rss_mb"]) for r in h["readings"])
    growth = h["rss_growth_mb"]
    share = f", {growth / h['rss_first_mb']:+.1%}" if growth is not None and h["rss_first_mb"] else ""
    later = h["later_turns"]
    return [
        f"history: {_n(h['tokens_sent'])} prompt tokens in {len(h['samples']):,} requests over "
        f"{h['conversations']:,} conversations ({h['window']} live at once, up to {h['turns']} turns of "
        f"~{h['words']} words), {h['errors']} errors; {size}; computed {_n(h['computed_tokens'])} tokens{cycled}",
        f"history: server RSS (MB) every 10%: {shown or '-'}; growth {_n(growth, 1)} MB{share}",
        f"history: conversation records at the end {_n(h['conversation_records'])}, evicted "
        f"{_n(h['conversation_evictions'])}, tokens reused from records {_n(h['conversation_hit_tokens'])}; "
        f"later turns that found their record {later['record_found']:,} of {later['n']:,}",
    ]


def _n(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def history_plot(scenarios: dict[str, dict[str, Any]], model: str | None, out_dir: Path) -> Path:
    """At each reading, against the prompt tokens sent so far: the server's RSS (flat once the
    pool is warm), and the pool's blocks in use and the conversation records it holds."""
    history, path = scenarios["history"], out_dir / "history.png"
    readings = [r for r in history["readings"] if r["rss_mb"] is not None]
    tokens = [r["tokens"] for r in readings]
    fig = figure(8, 6)
    rss_ax, pool_ax = fig.subplots(2, 1, sharex=True)
    rss_ax.plot(tokens, [r["rss_mb"] for r in readings], marker="o", color=COLORS["floor"])
    rss_ax.set_ylim(bottom=0)
    rss_ax.set_ylabel("server RSS (MB)")
    pool_ax.plot(tokens, [r["kv_blocks_used"] for r in readings], marker="o", color=COLORS["miss"])
    pool_ax.set_ylim(0, history["pool"]["blocks"] or None)
    pool_ax.set_ylabel(f"KV blocks in use (of {_count(history['pool']['blocks'])})", color=COLORS["miss"])
    records_ax = pool_ax.twinx()  # a few records, hundreds of blocks: an axis each
    records_ax.plot(tokens, [r["conversation_records"] for r in readings], marker="s", color=COLORS["hit"])
    records_ax.set_ylim(bottom=0)
    records_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    records_ax.set_ylabel("conversation records", color=COLORS["hit"])
    pool_ax.set_xlabel("prompt tokens sent")
    for ax in (rss_ax, pool_ax):
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"history: {history['tokens_sent']:,} prompt tokens over {history['conversations']:,} "
                 f"conversations: {model}")
    fig.savefig(path)
    return path


def _count(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"
