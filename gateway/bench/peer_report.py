"""The peer scenario's numbers, per server: miss and hit TTFT, decode ms/token of one stream,
aggregate output tokens/s per client count, prompt tokens and memory; their ratios (toolkv over
the peer); the side-by-side table (terminal and report.html) and the lines."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table

from gateway.bench.client import Sample
from gateway.bench.concurrency_report import case_stats
from gateway.bench.memory import PARTS, bytes_text
from gateway.bench.stats import (
    decode_s_per_token,
    ms_spread,
    num,
    output_tokens,
    percentile,
    ratio,
    rounded,
    times,
    ttft_stats,
)

SERVERS = ("toolkv", "peer")
PEER_COLUMNS = ("", "toolkv", "peer", "toolkv/peer")
PEER_CAPTION = ("p50 over the requests; the same bodies went to both servers, in turns; toolkv/peer below 1 "
                "for times and above 1 for tokens/s is toolkv ahead")


def peer_stats(samples: list[Sample], details: dict[str, Any]) -> dict[str, Any]:
    own = {server: [s for s in samples if s.tags.get("server") == server] for server in SERVERS}
    memory = details.get("memory") or {}
    servers = {server: _server(own[server], [c for c in details.get("cases", []) if c["server"] == server],
                               memory.get(server)) for server in SERVERS}
    toolkv, peer = servers["toolkv"], servers["peer"]
    ratios: dict[str, Any] = {key: ratio(toolkv[key]["p50"], peer[key]["p50"])
                              for key in ("miss_ttft_ms", "hit_ttft_ms", "decode_ms_per_token")}
    peer_cases = {c["clients"]: c for c in peer["clients"]}
    ratios["tokens_per_s"] = {str(c["clients"]): ratio(c["tokens_per_s"], peer_cases.get(c["clients"], {}).get(
        "tokens_per_s")) for c in toolkv["clients"]}
    return {"servers": servers, "ratios": ratios, "prompt_tokens": _prompt_pairs(samples),
            "errors": sum(s["errors"] for s in servers.values())}


def _server(samples: list[Sample], cases: list[dict[str, Any]], memory: dict[str, Any] | None) -> dict[str, Any]:
    def phase(name: str) -> list[Sample]:
        return [s for s in samples if s.tags.get("phase") == name and s.cache != "error"]

    hits, decode = phase("hit"), phase("decode")
    reported = [s.cached_tokens for s in hits if s.cached_tokens is not None]
    per_token = [t for s in decode if (t := decode_s_per_token(s)) is not None]
    clients = [_case(samples, c) for c in cases]
    prompts = [s.prompt_tokens for s in [*phase("miss"), *hits] if s.prompt_tokens is not None]
    return {"miss_ttft_ms": {"n": len(phase("miss")), **ttft_stats(phase("miss"))},
            "hit_ttft_ms": {"n": len(hits), **ttft_stats(hits)},
            "hits_cached": sum(1 for n in reported if n > 0) if len(reported) == len(hits) and hits else None,
            "decode_ms_per_token": {"n": len(per_token), **ms_spread(per_token)},
            "decode_tokens_p50": rounded(percentile([output_tokens(s) for s in decode], 50), 0),
            "prompt_tokens_p50": rounded(percentile(prompts, 50), 0),
            "clients": clients, "errors": sum(1 for s in samples if s.cache == "error"),
            "error_messages": sorted({s.error for s in samples if s.error})[:3], "memory": memory}


def _case(samples: list[Sample], case: dict[str, Any]) -> dict[str, Any]:
    """One client count on one server; no tokens/s when every request failed."""
    measured = [s for s in samples if s.tags.get("case") == f"{case['server']}@{case['clients']}"
                and s.tags.get("phase") == "clients"]
    stats = {"clients": case["clients"], "wall_s": case["wall_s"], **case_stats(measured, case["wall_s"])}
    if stats["errors"] == stats["n"]:
        stats["tokens_per_s"] = None
    return stats


def _prompt_pairs(samples: list[Sample]) -> dict[str, Any]:
    """Each body sent to both servers (a turn): did they count the same prompt tokens?"""
    by_turn: dict[int, dict[str, int | None]] = {}
    for s in samples:
        if "turn" in s.tags and s.cache != "error":
            by_turn.setdefault(s.tags["turn"], {})[s.tags["server"]] = s.prompt_tokens
    pairs = [(t["toolkv"], t["peer"]) for t in by_turn.values()
             if t.get("toolkv") is not None and t.get("peer") is not None]
    return {"pairs": len(pairs), "same": sum(1 for a, b in pairs if a == b),
            "peer_minus_toolkv_p50": rounded(percentile([b - a for a, b in pairs if a and b], 50), 0)}


def peer_rows(p: dict[str, Any]) -> list[list[str]]:
    """The side-by-side table's rows (PEER_COLUMNS)."""
    toolkv, peer, ratios = p["servers"]["toolkv"], p["servers"]["peer"], p["ratios"]
    rows = [[label, num(toolkv[key]["p50"], digits), num(peer[key]["p50"], digits), times(ratios[key])]
            for label, key, digits in (("miss TTFT (ms)", "miss_ttft_ms", 0), ("hit TTFT (ms)", "hit_ttft_ms", 0),
                                       ("decode, one stream (ms/token)", "decode_ms_per_token", 1))]
    peer_cases = {c["clients"]: c for c in peer["clients"]}
    rows += [[f"tokens/s, {c['clients']} client{'s' if c['clients'] != 1 else ''}", num(c["tokens_per_s"], 1),
              num(peer_cases.get(c["clients"], {}).get("tokens_per_s"), 1),
              times(ratios["tokens_per_s"].get(str(c["clients"])))] for c in toolkv["clients"]]
    rows.append(["prompt tokens", num(toolkv["prompt_tokens_p50"]), num(peer["prompt_tokens_p50"]), ""])
    memory = [toolkv["memory"] or {}, peer["memory"] or {}]
    rows += [[label, *(bytes_text(m.get(f"{part}_bytes")) for m in memory), ""] for part, label in PARTS.items()
             if any(m.get(f"{part}_bytes") is not None for m in memory)]
    return rows


def peer_table(p: dict[str, Any], peer_url: str) -> Table:
    table = Table(title=f"side by side: toolkv and the peer at {peer_url}", box=box.SIMPLE, caption=PEER_CAPTION)
    for column in PEER_COLUMNS:
        table.add_column(column, justify="left" if not column else "right", no_wrap=True)
    for row in peer_rows(p):
        table.add_row(*row)
    return table


def peer_lines(p: dict[str, Any]) -> list[str]:
    prompts, peer = p["prompt_tokens"], p["servers"]["peer"]
    lines = [_prompt_line(prompts)]
    cached = peer["hits_cached"]
    lines.append("peer: reports no cached_tokens" if cached is None else
                 f"peer: cached tokens on {cached} of {peer['hit_ttft_ms']['n']} repeats")
    for name in SERVERS:
        server = p["servers"][name]
        if server["errors"]:
            lines.append(f"peer: {server['errors']} failed requests on {name}: {'; '.join(server['error_messages'])}")
    return lines


def _prompt_line(prompts: dict[str, Any]) -> str:
    if not prompts["pairs"]:
        return "peer: no prompt token counts to compare (a server sent no usage, or no answer)"
    line = f"peer: the same prompt token count on {prompts['same']} of {prompts['pairs']} bodies sent to both"
    if prompts["same"] == prompts["pairs"]:
        return line
    return (f"{line} (peer - toolkv p50: {num(prompts['peer_minus_toolkv_p50'])}: a template or tokenizer of its "
            "own, or tools it drops; --tools-in-system writes them into the system message)")
