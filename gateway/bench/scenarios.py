"""The bench's scenarios, as a user runs them, and their registry. Each sends requests through a
`Context` and returns a `ScenarioResult` (context.py); the classes (hit / miss / bypass) come from
the server's `cached_tokens`, never from the plan. The lab (lab/scenarios.py) adds its own.

1 single           one tool group, different questions; extra misses on fresh groups; bypass requests
2 toolcount        one group per tool count (5/10/20/50), skipping counts beyond the model's context
3 interleaved      K groups sent A, B, C, A, B, C ... (a one-slot cache misses every time here)
4 restart          warm a group, restart the server, ask again (the disk tier should make it a hit)
5 concurrent       1, 4, 8 streaming clients at once, on one warm group and on mixed warm groups
6 compile-overlap  hits on a warm group alone, then while another group's first request compiles
7 soak             1,000 short requests over 8 groups from 4 clients; the server's RSS every 10%
8 agent            tau-bench conversations replayed turn by turn, each turn the whole conversation so far
                   (conversations.py)
9 peer             toolkv and another server side by side, same requests in turns (peer.py; runs when named
                   or with --peer-url)
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from rich.table import Table

from gateway.bench.agent_report import agent_lines, agent_stats, agent_table
from gateway.bench.client import ContextTooLong, Expected, Sample
from gateway.bench.concurrency_report import concurrency_lines, concurrency_table, concurrent_stats, overlap_stats
from gateway.bench.context import Context, Floors, Scenario, ScenarioResult, Scenarios
from gateway.bench.conversations import run_agent
from gateway.bench.forced import with_forced_tokens
from gateway.bench.names import SCENARIO_NAMES
from gateway.bench.peer import planned as peer_planned
from gateway.bench.peer import run_peer
from gateway.bench.peer_report import peer_lines, peer_stats, peer_table
from gateway.bench.report import block, interleaved_lines, restart_lines, single_lines, soak_lines, warm_samples
from gateway.bench.workload import ToolGroup, WorkloadError


async def run_single(ctx: Context) -> ScenarioResult:
    name, plan = "single", ctx.plan
    result = ScenarioResult(name)
    main = ctx.workload.group("main", plan.tools)
    result.samples.append(await ctx.send(name, main, "miss"))  # the first request computes the prefix
    load_at_first = os.getloadavg()[0] if ctx.server is not None and hasattr(os, "getloadavg") else None
    for i in range(max(plan.requests, plan.misses - 1, plan.bypass)):  # mixed, so noise hits all classes
        if i < plan.requests:
            result.samples.append(await ctx.send(name, main, "hit"))
        if i < plan.misses - 1:
            fresh = ctx.workload.group(f"fresh-{i + 1}", plan.tools)
            result.samples.append(await ctx.send(name, fresh, "miss"))
        if i < plan.bypass:
            result.samples.append(await ctx.send(name, main, "bypass", bypass=True))
    first = result.samples[0]
    later = sorted(t for s in result.samples[1:] if s.cache == "miss" and (t := s.ttft_s) is not None)
    # a spawned server's first request is the first after its start: warm-up should have paid the rest
    result.details.update(first_miss_ttft_ms=None if first.ttft_s is None else round(first.ttft_s * 1000, 1),
                          first_over_later_miss=_ratio(first.ttft_s, later[len(later) // 2] if later else None),
                          first_after_start=ctx.server is not None,
                          # how busy the machine was (a spawned server's: this one), with its cores
                          first_load_average=None if load_at_first is None else round(load_at_first, 1),
                          num_cpus=os.cpu_count())
    return result


async def run_toolcount(ctx: Context) -> ScenarioResult:
    name, plan = "toolcount", ctx.plan
    result = ScenarioResult(name, details={"skipped_counts": {}})
    for count in plan.tool_counts:
        try:
            group = ctx.workload.group(f"tools-{count}", count)
            result.samples.append(await ctx.send(name, group, "miss"))
        except (ContextTooLong, WorkloadError) as exc:
            result.details["skipped_counts"][str(count)] = str(exc)
            result.notes.append(f"{count} tools skipped: {exc}")
            ctx.on_skip(1 + plan.hits_per_count)
            continue
        for _ in range(plan.hits_per_count):
            result.samples.append(await ctx.send(name, group, "hit"))
    return result


async def run_interleaved(ctx: Context) -> ScenarioResult:
    name, plan = "interleaved", ctx.plan
    try:
        groups = [ctx.workload.group(chr(ord("A") + k), plan.tools, offset=k * plan.tools)
                  for k in range(plan.groups)]
    except WorkloadError as exc:
        ctx.on_skip(plan.groups * plan.rounds)
        return ScenarioResult(name, skipped=str(exc))
    result = ScenarioResult(name)
    for round_index in range(plan.rounds):
        for group in groups:
            expected: Expected = "miss" if round_index == 0 else "hit"
            result.samples.append(await ctx.send(name, group, expected, round=round_index))
    repeats = [s for s in result.samples if s.expected == "hit"]
    result.details.update(order="".join(s.group for s in result.samples),
                          sequence=[s.cache for s in result.samples],
                          every_repeat_hit=bool(repeats) and all(s.cache == "hit" for s in repeats))
    return result


async def run_restart(ctx: Context) -> ScenarioResult:
    name = "restart"
    if ctx.server is None:
        ctx.on_skip(3)
        return ScenarioResult(name, skipped="needs --spawn: the bench must start and stop the server itself")
    result = ScenarioResult(name)
    group = ctx.workload.group("R", ctx.plan.tools)
    before = await ctx.send(name, group, "miss", phase="before-restart")
    started = time.perf_counter()
    ctx.client.rebase(await ctx.server.restart())
    restart_s = time.perf_counter() - started
    first = await ctx.send(name, group, "any", phase="first-after-restart")
    again = await ctx.send(name, group, "hit", phase="second-after-restart")
    result.samples += [before, first, again]
    result.details.update(restart_s=round(restart_s, 2), first_after_restart=first.cache,
                          restart_speedup=_ratio(before.ttft_s, first.ttft_s))
    if first.cache != "hit":
        result.notes.append("the first request after the restart missed: the server kept no disk tier "
                            "entry for the group (disk tier absent, disabled or not written)")
    return result


CONCURRENT_MODES = ("one-group", "mixed-groups")


async def run_concurrent(ctx: Context) -> ScenarioResult:
    """For each mode and client count: warm the case's groups (sequential, 1 token each), then
    start every client at once; each sends `requests_per_client` streaming requests one after
    another. One group: all clients on the same group. Mixed groups: client c's r-th request goes
    to group (c + r) mod G, so simultaneous requests are on different groups. Aggregate output
    tokens/s = completion tokens of the case / its wall time (first send to last token)."""
    name, plan = "concurrent", ctx.plan
    result = ScenarioResult(name, details={"cases": []})
    shared = ctx.workload.group("shared", plan.tools)
    # The same tools under another label (in the system message): groups of their own, with prefixes
    # of the same length as the one group's, so the modes differ only in how many groups are in play.
    mixed = [shared] + [ctx.workload.group(f"mixed-{k + 1}", plan.tools) for k in range(1, plan.mixed_groups)]
    for mode in CONCURRENT_MODES:
        for clients in plan.clients:
            case = f"{mode}@{clients}"
            used = min(len(mixed), clients + plan.requests_per_client - 1)  # distinct (c + r) mod G
            groups = [shared] if mode == "one-group" else mixed[:used]
            for group in groups:  # a warm group is a cheap hit; a group the LRU evicted is computed again
                result.samples.append(await ctx.send(name, group, "any", max_tokens=1, phase="warm", case=case))

            async def one_client(client_id: int, groups: list[ToolGroup] = groups, case: str = case) -> list[Sample]:
                return [await ctx.send(name, groups[(client_id + r) % len(groups)], "hit", talk=True,
                                       max_tokens=plan.concurrent_max_tokens, phase="measure", case=case,
                                       client=client_id)
                        for r in range(plan.requests_per_client)]

            started = time.perf_counter()
            batches = await asyncio.gather(*(one_client(c) for c in range(clients)))
            wall_s = time.perf_counter() - started
            result.samples += [s for batch in batches for s in batch]
            result.details["cases"].append({"case": case, "mode": mode, "clients": clients,
                                            "groups": len(groups),
                                            "requests_per_client": plan.requests_per_client,
                                            "max_tokens": plan.concurrent_max_tokens, "wall_s": round(wall_s, 3)})
    return result


async def run_compile_overlap(ctx: Context) -> ScenarioResult:
    """Hits on a warm group: first alone (one after another), then while another group's first
    request (a miss: its prefix compiles) runs. The compile request is sent first; once it is on
    the wire, hits go out one after another until it returns its first token (it asks for one).
    A hit counts as during the compile when it was sent before the compile's first token arrived."""
    name, plan = "compile-overlap", ctx.plan
    hot = ctx.workload.group("shared", plan.tools)
    try:
        fresh = ctx.workload.group("compile", plan.compile_tools)  # 20 tools from tool 0: ~3,000 tokens
    except WorkloadError as exc:
        ctx.on_skip(SCENARIOS[name].planned(plan))
        return ScenarioResult(name, skipped=str(exc))
    result = ScenarioResult(name)
    result.samples.append(await ctx.send(name, hot, "any", max_tokens=1, phase="warm"))
    for _ in range(plan.alone_hits):
        result.samples.append(await ctx.send(name, hot, "hit", phase="alone"))
    on_wire = asyncio.Event()
    compile_task = asyncio.create_task(ctx.send(name, fresh, "miss", max_tokens=1, on_sent=on_wire.set,
                                                phase="compile"))
    waiter = asyncio.create_task(on_wire.wait())
    await asyncio.wait({compile_task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    during: list[Sample] = []
    while not compile_task.done() and len(during) < plan.max_hits_during_compile:
        during.append(await ctx.send(name, hot, "hit", phase="during-compile"))
    compile_sample = await compile_task
    first_token_at = compile_sample.started_s + (compile_sample.ttft_s or compile_sample.total_s)
    for s in during:
        s.tags["overlapped"] = s.started_s < first_token_at
    result.samples += [compile_sample, *during]
    result.details.update(
        compile_group_tools=fresh.num_tools, compile_cache=compile_sample.cache,
        compile_prompt_tokens=compile_sample.prompt_tokens,
        compile_ttft_ms=None if compile_sample.ttft_s is None else round(compile_sample.ttft_s * 1000, 1),
        compile_server_ms=(compile_sample.server_timing_ms or {}).get("compile"))
    if compile_sample.cache != "miss":
        result.notes.append(f"the compile request was a {compile_sample.cache}, not a miss: nothing compiled")
    if not any(s.tags["overlapped"] for s in during):
        result.notes.append("no hit was sent while the compile ran")
    return result


async def run_soak(ctx: Context) -> ScenarioResult:
    """`soak_requests` short requests (2 tokens) over `soak_groups` groups from `soak_clients`
    clients at once; the server's resident memory is read from its /metrics after every tenth of
    the run. Growth is measured from the first reading (after 10%: every group is warm by then) to
    the last: a server whose KV is bounded by a preallocated pool stays flat."""
    name, plan = "soak", ctx.plan
    groups = [ctx.workload.group(f"soak-{k}", plan.soak_tools) for k in range(plan.soak_groups)]
    result = ScenarioResult(name)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(plan.soak_requests):
        queue.put_nowait(i)
    every = max(1, plan.soak_requests // 10)
    readings: list[tuple[int, float | None]] = []
    done = 0

    async def client() -> None:
        nonlocal done
        while not queue.empty():
            i = queue.get_nowait()
            result.samples.append(await ctx.send(name, groups[i % len(groups)], "any", max_tokens=2, phase="soak"))
            done += 1
            if done % every == 0:
                readings.append((done, await ctx.client.resident_mb()))

    await asyncio.gather(*(client() for _ in range(plan.soak_clients)))
    rss = [mb for _, mb in readings if mb is not None]
    result.details.update(requests=plan.soak_requests, groups=plan.soak_groups, clients=plan.soak_clients,
                          rss_mb=[{"requests": n, "rss_mb": mb} for n, mb in readings],
                          rss_growth_mb=round(rss[-1] - rss[0], 1) if len(rss) >= 2 else None,
                          rss_first_mb=rss[0] if rss else None)
    if not rss:
        result.notes.append("the server exports no process_resident_memory_bytes: RSS not measured")
    return result


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 2) if numerator and denominator else None


def _block(result: ScenarioResult, floors: Floors) -> dict[str, Any]:
    return block(result.samples, floors)


def _single_stats(result: ScenarioResult, floors: Floors) -> dict[str, Any]:
    """The first request has its own line: the miss column is warm misses."""
    return block(warm_samples(result.samples), floors)


def _toolcount_stats(result: ScenarioResult, floors: Floors) -> dict[str, Any]:
    """One block per size: a speedup across sizes means nothing."""
    counts = sorted({s.num_tools for s in result.samples})
    return {"by_tools": {str(n): block([s for s in result.samples if s.num_tools == n], floors) for n in counts}}


def _soak_stats(result: ScenarioResult, floors: Floors) -> dict[str, Any]:
    """About memory (details): the samples' timings are in `samples`."""
    return {"errors": sum(1 for s in result.samples if s.cache == "error")}


def _peer_table(s: Scenarios) -> Table:
    return peer_table(s["peer"], s["peer"]["peer_url"])


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("single", with_forced_tokens(run_single), lambda p: 1 + p.requests + max(p.misses - 1, 0) + p.bypass,
             _single_stats, in_table=True, lines=single_lines),
    Scenario("toolcount", run_toolcount, lambda p: len(p.tool_counts) * (1 + p.hits_per_count), _toolcount_stats,
             in_table=True),
    Scenario("interleaved", run_interleaved, lambda p: p.groups * p.rounds, _block, in_table=True,
             lines=interleaved_lines),
    Scenario("restart", run_restart, lambda p: 3, _block, in_table=True, lines=restart_lines),
    Scenario("concurrent", with_forced_tokens(run_concurrent),
             lambda p: len(p.clients) * (1 + p.mixed_groups) + 2 * sum(p.clients) * p.requests_per_client,
             lambda r, f: concurrent_stats(r.samples, r.details.get("cases", [])),
             table=concurrency_table, lines=concurrency_lines),
    Scenario("compile-overlap", run_compile_overlap, lambda p: 1 + p.alone_hits + 1 + 3,  # ~3 hits during
             lambda r, f: overlap_stats(r.samples), table=concurrency_table, lines=concurrency_lines),
    Scenario("soak", run_soak, lambda p: p.soak_requests, _soak_stats, lines=soak_lines),
    Scenario("agent", with_forced_tokens(run_agent), lambda p: p.agent_turns, lambda r, f: agent_stats(r.samples),
             table=lambda s: agent_table(s["agent"]), lines=lambda s: agent_lines(s["agent"])),
    Scenario("peer", run_peer, peer_planned, lambda r, f: peer_stats(r.samples, r.details), table=_peer_table,
             lines=lambda s: peer_lines(s["peer"])),
)}
assert tuple(SCENARIOS) == SCENARIO_NAMES  # the command line lists them without importing this module
