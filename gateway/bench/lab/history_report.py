"""The history scenario's numbers: errors, how many later turns found their conversation's record
still in the pool, RSS growth over the run and its target, and the summary lines."""

from __future__ import annotations

from typing import Any

from gateway.bench.client import Sample

TARGET_HISTORY_RSS_GROWTH = 0.05  # RSS from the first reading (10%) to the last grows by at most this share


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


def history_target(history: dict[str, Any]) -> bool | None:
    """RSS flat: growth from the first reading to the last at most 5% of the first (None: not measured)."""
    growth, first = history.get("rss_growth_mb"), history.get("rss_first_mb")
    return None if growth is None or not first else growth <= TARGET_HISTORY_RSS_GROWTH * first


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
