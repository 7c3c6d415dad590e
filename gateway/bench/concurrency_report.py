"""The concurrent and compile-overlap scenarios' numbers: per case hit TTFT and aggregate output
tokens/s, the ratios against the same mode's fewest clients and at 4 clients over 1; hit TTFT
alone against during another group's compile; their table and their lines."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table

from gateway.bench.client import Sample
from gateway.bench.stats import ms_spread, num, percentile, ratio, rounded, times, ttft_stats

CONCURRENCY_SCENARIOS = ("concurrent", "compile-overlap")


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
            "tokens_per_s": rounded(tokens / wall_s, 2) if wall_s > 0 else None,
            "requests_per_s": rounded(len(samples) / wall_s, 3) if wall_s > 0 else None,
            "decode_tokens_per_s_per_request_p50": rounded(percentile(rates, 50), 2)}


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
            c["tokens_per_s_vs_base"] = ratio(c["tokens_per_s"], base["tokens_per_s"])
            c["hit_ttft_p50_vs_base"] = ratio(c["hit_ttft_ms"]["p50"], base["hit_ttft_ms"]["p50"])
            c["base_clients"] = base["clients"]
        by_clients = {c["clients"]: c for c in own}
        one, four = by_clients.get(1), by_clients.get(4)
        ratios[mode] = {
            "tokens_per_s_4_over_1": ratio(four["tokens_per_s"], one["tokens_per_s"]) if one and four else None,
            "hit_ttft_p50_4_over_1": (ratio(four["hit_ttft_ms"]["p50"], one["hit_ttft_ms"]["p50"])
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
            "during_over_alone": ratio(during_ttft["p50"], alone_ttft["p50"]),
            "during_over_alone_p95": ratio(during_ttft["p95"], alone_ttft["p95"]),
            "errors": sum(1 for s in samples if s.cache == "error")}


def concurrency_table(scenarios: dict[str, dict[str, Any]]) -> Table | None:
    """One row per concurrency case and per compile-overlap phase; None when neither ran."""
    ran = {n: s for n in CONCURRENCY_SCENARIOS if (s := scenarios.get(n)) and not s.get("skipped")}
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
                      num(c["hit_ttft_ms"]["p50"]), num(c["hit_ttft_ms"]["p95"]), num(c["tokens_per_s"], 1),
                      times(c["tokens_per_s_vs_base"]), times(c["hit_ttft_p50_vs_base"]))
    if "compile-overlap" in ran:
        o = ran["compile-overlap"]
        for label, part, by in (("hit alone", o["hit_alone"], None),
                                ("hit+compile", o["hit_during_compile"], o["during_over_alone"])):
            table.add_row(label, "1", "1", str(part["n"]), num(part["ttft_ms"]["p50"]), num(part["ttft_ms"]["p95"]),
                          "-", "-", times(by))
        table.add_row("compile", "", "", o["compile_cache"], num(o["compile_ttft_ms"]), "", "", "", "")
    return table


def concurrency_lines(scenarios: dict[str, dict[str, Any]]) -> list[str]:
    """The ratios at 4 clients over 1 per mode, and the compile-overlap's, when they ran."""
    lines = []
    if "concurrent" in scenarios and not scenarios["concurrent"].get("skipped"):
        for mode, r in scenarios["concurrent"]["ratios"].items():
            if r["tokens_per_s_4_over_1"] is None and r["hit_ttft_p50_4_over_1"] is None:
                continue
            lines.append(f"concurrent, {mode}: output tokens/s at 4 clients / 1 client = "
                         f"{times(r['tokens_per_s_4_over_1'])}; "
                         f"hit TTFT p50 at 4 clients / 1 client = {times(r['hit_ttft_p50_4_over_1'])}")
    if "compile-overlap" in scenarios and not scenarios["compile-overlap"].get("skipped"):
        o = scenarios["compile-overlap"]
        lines.append(f"compile-overlap: hit TTFT p50 during a compile / alone = {times(o['during_over_alone'])}; "
                     f"the compile ({o['compile_group_tools']} tools, "
                     f"{num(o['compile_prompt_tokens'])} prompt tokens, a {o['compile_cache']}): TTFT "
                     f"{num(o['compile_ttft_ms'])} ms"
                     + (f", server compile {o['compile_server_ms']:,.0f} ms" if o.get("compile_server_ms") else ""))
    return lines
