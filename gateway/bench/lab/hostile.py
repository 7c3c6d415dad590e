"""The hostile-soak scenario: key B (normal) sends small chat requests on a tool group
alone, then again while key A sends a concurrent hostile mix (bodies near the size limit, nesting
past the depth limit, multi-MB tool-call arguments, many distinct large `response_format` schemas,
malformed JSON, streams dropped mid-way). It measures B's latency under attack against alone, the
server's RSS (its /metrics) when key A starts and at the end (and at the scenario's start: B's
first group and the first requests' one-time allocations are no growth A caused), and the status
of every hostile request: a 5xx (or a dropped connection the bench did not drop itself) is a
failure.

Key A is $HOSTILE_SOAK_KEY; with `--spawn` the bench starts the server with both keys
(`spawn_env`). Against a running server without that variable, A sends with B's key (noted).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from collections import Counter
from typing import Any

import httpx

from gateway.bench.client import Sample
from gateway.bench.context import Context, ScenarioResult
from gateway.bench.stats import percentile

NAME = "hostile-soak"
HOSTILE_KEY_ENV = "HOSTILE_SOAK_KEY"  # not TOOLKV_: a spawned server would warn of an unknown setting
SPAWN_NORMAL_KEY = "bench-normal-key"
SPAWN_HOSTILE_KEY = "bench-hostile-key"
HOSTILE_WORKERS = 2  # key A's concurrent senders
B_TOOLS = 5  # B's small tool group
NEAR_LIMIT_BYTES = 4 * 1024**2 - 64 * 1024  # just under the default max_request_bytes (4 MiB)
DEEP_NESTING = 2_000  # far past the document depth limit
TOOL_ARGS_BYTES = 2 * 1024**2
SCHEMA_PROPERTIES = 400  # ~20 KB per response_format schema, each one distinct
SPAWN_BOUNDS = {"TOOLKV_RAM_BUDGET_BYTES": "256MiB", "TOOLKV_GRAMMAR_CACHE_BYTES": "32MiB"}
RSS_READINGS = 10  # the server's RSS read after every tenth of B's requests under attack


def spawn_env(api_key: str | None) -> tuple[str, dict[str, str]]:
    """Key B (the bench's own key) and the spawned server's env: keys B and A."""
    normal = api_key or SPAWN_NORMAL_KEY
    os.environ.setdefault(HOSTILE_KEY_ENV, SPAWN_HOSTILE_KEY)
    return normal, {"TOOLKV_API_KEYS": f"{normal},{os.environ[HOSTILE_KEY_ENV]}"}


def spawn_bounds() -> dict[str, str]:
    """A spawned server's memory bounds for the soak, small enough that each fills within the run
    (unless set in the environment): the KV pool's pages become resident as blocks are first
    written, and the grammar cache fills with key A's distinct schemas, so at the default sizes
    (2 GiB, 256 MiB) RSS climbs toward those bounds for the whole run, by design. Filled early,
    what is left of RSS growth is memory no bound holds."""
    return {name: os.environ.get(name, value) for name, value in SPAWN_BOUNDS.items()}


def planned(plan: Any) -> int:
    return 2 * (1 + b_requests(plan))


def b_requests(plan: Any) -> int:
    return max(3, 3 * int(plan.requests))


def _chat(model: str | None, text: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2, **extra}


def _deep(model: str | None) -> bytes:
    """Arrays nested DEEP_NESTING deep, written as text (json.dumps would recurse past Python's limit)."""
    text = json.dumps(_chat(model, "hi", metadata={"deep": "@"}))
    return text.replace('"@"', "[" * DEEP_NESTING + '"leaf"' + "]" * DEEP_NESTING).encode()


def hostile_bodies(model: str | None, serial: int) -> list[tuple[str, bytes, bool]]:
    """One round of key A's mix: (kind, raw body, drop mid-stream)."""
    pad = "x" * NEAR_LIMIT_BYTES
    schema = {"type": "object", "properties": {f"f{serial}_{i}": {"type": "string", "description": "d" * 32}
                                               for i in range(SCHEMA_PROPERTIES)}}
    args = json.dumps({"blob": "y" * TOOL_ARGS_BYTES})
    call = {"id": f"call_{serial}", "type": "function", "function": {"name": "lookup", "arguments": args}}
    tool_msgs = [{"role": "user", "content": "look it up"},
                 {"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": f"call_{serial}", "content": "ok"}]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    bodies: list[tuple[str, Any, bool]] = [
        ("oversized", _chat(model, pad), False),
        ("over-limit", _chat(model, pad + "x" * 128 * 1024), False),
        ("deep-nesting", _deep(model), False),
        ("tool-call-args", {"model": model, "messages": tool_msgs, "tools": tools, "max_tokens": 2}, False),
        ("response-format", _chat(model, "answer in JSON", response_format={
            "type": "json_schema", "json_schema": {"name": f"s{serial}", "schema": schema}}), False),
        ("malformed-json", b'{"model": "m", "messages": [{"role": "user", "content": "hi"', False),
        ("disconnect", _chat(model, "tell me a long story", max_tokens=64, stream=True), True),
    ]
    return [(k, b if isinstance(b, bytes) else json.dumps(b).encode(), drop) for k, b, drop in bodies]


async def _hostile_one(http: httpx.AsyncClient, url: str, body: bytes, drop: bool) -> str:
    """The status code as text, or 'error: ...' when the server dropped the connection."""
    try:
        async with http.stream("POST", url, content=body, headers={"Content-Type": "application/json"}) as resp:
            if drop and resp.status_code == 200:
                async for _ in resp.aiter_bytes():
                    break  # the first chunk, then go away mid-stream
                return "200 (dropped)"
            await resp.aread()
            return str(resp.status_code)
    except httpx.HTTPError as exc:
        return f"error: {type(exc).__name__}"


async def _attack(ctx: Context, key: str | None, stop: asyncio.Event, statuses: dict[str, Counter[str]]) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = ctx.client.api_url("/chat/completions")
    serial = itertools.count()
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(ctx.client.timeout_s, connect=10.0)) as http:
        async def worker() -> None:
            while not stop.is_set():
                for kind, body, drop in hostile_bodies(ctx.workload.model, next(serial)):
                    if stop.is_set():
                        return
                    statuses.setdefault(kind, Counter())[await _hostile_one(http, url, body, drop)] += 1
        await asyncio.gather(*(worker() for _ in range(HOSTILE_WORKERS)))


async def _b_phase(ctx: Context, phase: str, n: int, samples: list[Sample],
                   readings: list[float | None] | None = None) -> None:
    """B's requests one after another; with `readings`, the server's RSS after every tenth of them."""
    group = ctx.workload.group("hostile-b", B_TOOLS)
    await ctx.send(NAME, group, "any", phase=phase, warmup=True)  # not timed: the group's first request
    for i in range(n):
        samples.append(await ctx.send(NAME, group, "hit", phase=phase, warmup=False))
        if readings is not None and (i + 1) % max(1, n // RSS_READINGS) == 0:
            readings.append(await ctx.client.resident_mb())


def _ms(samples: list[Sample], q: float, ttft: bool = False) -> float | None:
    values = [(s.ttft_s if ttft else s.total_s) for s in samples if s.error is None]
    value = percentile([v * 1000 for v in values if v is not None], q)
    return None if value is None else round(value, 1)


async def run_hostile_soak(ctx: Context) -> ScenarioResult:
    result = ScenarioResult(NAME)
    key = os.environ.get(HOSTILE_KEY_ENV)
    if not key:
        result.notes.append(f"{HOSTILE_KEY_ENV} unset: the hostile traffic used key B's key")
        key = ctx.client.api_key
    n = b_requests(ctx.plan)
    rss_fresh = await ctx.client.resident_mb()
    alone: list[Sample] = []
    await _b_phase(ctx, "alone", n, alone)
    rss_start = await ctx.client.resident_mb()
    statuses: dict[str, Counter[str]] = {}
    stop = asyncio.Event()
    attack = asyncio.create_task(_attack(ctx, key, stop, statuses))
    attacked: list[Sample] = []
    readings: list[float | None] = [rss_start]
    try:
        await asyncio.sleep(0.5)  # let key A's first requests land before B's
        await _b_phase(ctx, "attack", n, attacked, readings)
    finally:
        stop.set()
        await attack
    rss_end = await ctx.client.resident_mb()
    result.samples = alone + attacked
    result.details = hostile_details(alone, attacked, rss_start, rss_end, statuses)
    result.details["rss_fresh_mb"] = rss_fresh
    result.details["rss_during_attack_mb"] = [*readings, rss_end]
    return result


def hostile_details(alone: list[Sample], attacked: list[Sample], rss_start: float | None, rss_end: float | None,
                    statuses: dict[str, Counter[str]]) -> dict[str, Any]:
    p50_alone, p50_attack = _ms(alone, 50), _ms(attacked, 50)
    p95_alone, p95_attack = _ms(alone, 95), _ms(attacked, 95)
    failures = sum(n for counts in statuses.values() for code, n in counts.items()
                   if code.startswith("5") or code.startswith("error"))
    return {
        "b_requests": len(alone),
        "b_errors": sum(1 for s in alone + attacked if s.error is not None),
        "b_alone_ms": {"p50": p50_alone, "p95": p95_alone, "ttft_p50": _ms(alone, 50, ttft=True)},
        "b_attack_ms": {"p50": p50_attack, "p95": p95_attack, "ttft_p50": _ms(attacked, 50, ttft=True)},
        "b_ratio_p50": round(p50_attack / p50_alone, 2) if p50_alone and p50_attack else None,
        "b_ratio_p95": round(p95_attack / p95_alone, 2) if p95_alone and p95_attack else None,
        "rss_start_mb": rss_start, "rss_end_mb": rss_end,
        "rss_growth_mb": None if rss_start is None or rss_end is None else round(rss_end - rss_start, 1),
        "hostile_requests": sum(sum(c.values()) for c in statuses.values()),
        "hostile_statuses": {kind: dict(sorted(c.items())) for kind, c in sorted(statuses.items())},
        "hostile_failures": failures,
    }


def hostile_lines(h: dict[str, Any]) -> list[str]:
    a, b = h["b_alone_ms"], h["b_attack_ms"]

    def n(v: Any) -> str:
        return "-" if v is None else f"{v:,.1f}"
    codes = "; ".join(f"{k} " + ", ".join(f"{c}x{m}" for c, m in v.items()) for k, v in h["hostile_statuses"].items())
    return [
        f"hostile-soak: key B {h['b_requests']} requests alone: latency p50 {n(a['p50'])} / p95 {n(a['p95'])} ms "
        f"(TTFT p50 {n(a['ttft_p50'])}); under attack: p50 {n(b['p50'])} / p95 {n(b['p95'])} ms "
        f"(TTFT p50 {n(b['ttft_p50'])}); ratio p50 {n(h['b_ratio_p50'])}x, p95 {n(h['b_ratio_p95'])}x; "
        f"B errors {h['b_errors']}",
        f"hostile-soak: server RSS start {n(h['rss_start_mb'])} MB (when key A started; "
        f"{n(h.get('rss_fresh_mb'))} MB before key B's first request), end {n(h['rss_end_mb'])} MB, growth "
        f"{n(h['rss_growth_mb'])} MB; {h['hostile_requests']} hostile requests, {h['hostile_failures']} 5xx or "
        f"dropped by the server: {codes}",
        *(["hostile-soak: server RSS (MB) from key A's start, after every tenth of B's requests, to the end: "
           + ", ".join(n(v) for v in h["rss_during_attack_mb"])] if h.get("rss_during_attack_mb") else []),
    ]
