"""The eleven scenarios. Each sends requests through a `Context` and returns a `ScenarioResult`;
the classes (hit / miss / bypass) come from the server's `cached_tokens`, never from the plan.

1 single           one tool group, different questions; extra misses on fresh groups; bypass requests
2 toolcount        one group per tool count (5/10/20/50), skipping counts beyond the model's context
3 interleaved      K groups sent A, B, C, A, B, C ... (a one-slot cache misses every time here)
4 restart          warm a group, restart the server, ask again (the disk tier should make it a hit)
5 concurrent       1, 4, 8 streaming clients at once, on one warm group and on mixed warm groups
6 compile-overlap  hits on a warm group alone, then while another group's first request compiles
7 soak             1,000 short requests over 8 groups from 4 clients; the server's RSS every 10%
8 agent            tau-bench conversations replayed turn by turn, each turn the whole conversation so far
9 history          a million tokens of synthetic conversations through the KV pool; the server's RSS every 10%
10 constrained     BFCL-style rows with forced calls and structured outputs: validity, and the grammar's cost
                   per token against decode's (constrained.py)
11 fleet           replicas behind one ingress: interleaved groups, one hot group against balanced ones, and a
                   round-robin baseline (fleet.py)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.bench.client import BenchClient, ContextTooLong, Expected, Sample
from gateway.bench.constrained import ConstrainedRows, run_constrained
from gateway.bench.fleet import BaselineFleet, run_fleet
from gateway.bench.fleet import planned as fleet_planned
from gateway.bench.history import (
    HistoryChats,
    approx_prompt_tokens,
    counters_grown,
    expected_requests,
    pool_reading,
    pool_size,
)
from gateway.bench.options import SCENARIO_NAMES
from gateway.bench.trajectories import Conversation, Trajectories, turn_body
from gateway.bench.workload import ToolGroup, Workload, WorkloadError


@dataclass(frozen=True, slots=True)
class Plan:
    tools: int = 20  # tools per group (scenarios 1, 3, 4, 5)
    tool_counts: tuple[int, ...] = (5, 10, 20, 50)
    hits_per_count: int = 2
    requests: int = 8  # hits on the main group of scenario 1
    misses: int = 3
    bypass: int = 3
    groups: int = 3
    rounds: int = 3
    clients: tuple[int, ...] = (1, 4, 8)  # one case per count, on one group and on mixed groups
    requests_per_client: int = 2
    mixed_groups: int = 4  # groups the mixed-group cases spread their clients over
    concurrent_max_tokens: int = 32  # long enough answers for output tokens/s to mean something
    compile_tools: int = 20  # the group that compiles during the hits (20 tools: ~3,000 tokens)
    alone_hits: int = 3  # compile-overlap: hits timed with nothing else running
    max_hits_during_compile: int = 50
    soak_requests: int = 1000
    soak_groups: int = 8
    soak_tools: int = 5  # small groups: the soak measures memory over many requests, not prefill
    soak_clients: int = 4
    conversations: int = 1  # agent: tau-bench conversations replayed, in (task, trial) order
    agent_max_tokens: int = 16
    agent_turns: int = 0  # requests the agent scenario sends: its conversations' turns, once loaded
    history_tokens: int = 1_000_000  # history: prompt tokens to send, over all conversations
    history_window: int = 16  # conversations live at once
    history_turns: int = 8  # turns per conversation (~3,500 prompt tokens at the last with 5 tools)
    history_words: int = 300  # words per user message (~310 tokens)
    history_tools: int = 5
    history_max_tokens: int = 4
    constrained_max_tokens: int = 512  # a forced call or an answer cut by max_tokens is a failure
    constrained_requests: int = 0  # requests the constrained scenario sends, once its rows are loaded
    fleet_groups: int = 4  # fleet: groups interleaved, one request at a time
    fleet_rounds: int = 5
    fleet_clients: int = 4  # the hot group's clients and the balanced case's (one group each)
    fleet_requests_per_client: int = 3  # measured, after a warming round

    @classmethod
    def quick(cls, tools: int = 10) -> Plan:
        return cls(tools=tools, tool_counts=(5, 10, 20), hits_per_count=1, requests=3, misses=1, bypass=1,
                   groups=2, rounds=2, clients=(1, 4), requests_per_client=1, mixed_groups=2,
                   concurrent_max_tokens=8, compile_tools=tools, alone_hits=2, soak_requests=100, soak_groups=4,
                   history_tokens=100_000, fleet_requests_per_client=2)


class Restartable(Protocol):
    async def restart(self) -> str:
        """Stop the server and start it again on the same cache dir; return the new base URL."""


@dataclass(slots=True)
class Context:
    client: BenchClient
    workload: Workload
    plan: Plan
    server: Restartable | None
    on_sample: Callable[[Sample], None]
    on_skip: Callable[[int], None]  # planned requests that will not be sent
    trajectories: Trajectories | None = None  # the agent scenario's conversations
    rows: ConstrainedRows | None = None  # the constrained scenario's rows
    baseline: BaselineFleet | None = None  # the fleet scenario's round-robin fleet

    async def send(self, scenario: str, group: ToolGroup, expected: Expected, *, bypass: bool = False,
                   max_tokens: int | None = None, talk: bool = False, on_sent: Callable[[], None] | None = None,
                   **tags: Any) -> Sample:
        sample = Sample(scenario, group.label, group.num_tools, group.offset, expected, bypass, 0.0, tags=tags)
        return await self.send_body(sample, self.workload.body(group, max_tokens, talk=talk), on_sent)

    async def send_body(self, sample: Sample, body: dict[str, Any],
                        on_sent: Callable[[], None] | None = None) -> Sample:
        await self.client.chat(body, sample, on_sent)
        self.on_sample(sample)
        return sample


@dataclass(slots=True)
class ScenarioResult:
    name: str
    samples: list[Sample] = field(default_factory=list)
    skipped: str | None = None  # why the whole scenario did not run
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


async def run_single(ctx: Context) -> ScenarioResult:
    name, plan = "single", ctx.plan
    result = ScenarioResult(name)
    main = ctx.workload.group("main", plan.tools)
    result.samples.append(await ctx.send(name, main, "miss"))  # the first request computes the prefix
    for i in range(max(plan.requests, plan.misses - 1, plan.bypass)):  # mixed, so noise hits all classes
        if i < plan.requests:
            result.samples.append(await ctx.send(name, main, "hit"))
        if i < plan.misses - 1:
            fresh = ctx.workload.group(f"fresh-{i + 1}", plan.tools)
            result.samples.append(await ctx.send(name, fresh, "miss"))
        if i < plan.bypass:
            result.samples.append(await ctx.send(name, main, "bypass", bypass=True))
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


async def run_agent(ctx: Context) -> ScenarioResult:
    """Each conversation's turns in order, one request each with the whole conversation so far (the
    rows and the summary are computed in agent_report)."""
    name = "agent"
    if ctx.trajectories is None:
        return ScenarioResult(name, skipped="no trajectories loaded")
    result = ScenarioResult(name, details={"conversations": len(ctx.trajectories.conversations),
                                           "max_tokens": ctx.plan.agent_max_tokens})
    for conversation in ctx.trajectories.conversations:
        await _replay(ctx, conversation, ctx.trajectories.tools, result)
    answered = [s for s in result.samples if s.error is None]
    if answered and all(s.prompt_tokens is None for s in answered):
        result.notes.append("the server sent no usage in its stream: prompt, cached and computed tokens unknown, "
                            "only TTFT measured (the same turns sent to toolkv give the token counts)")
    elif answered and all(s.cached_tokens is None for s in answered):
        result.notes.append("the server reports no usage.prompt_tokens_details.cached_tokens: computed tokens unknown")
    return result


async def _replay(ctx: Context, conversation: Conversation, tools: tuple[dict[str, Any], ...],
                  result: ScenarioResult) -> None:
    """One request per turn; a turn beyond the model's context ends its conversation."""
    for position, turn in enumerate(conversation.turns):
        sample = Sample(result.name, conversation.label, len(tools), 0, "any", False, 0.0,
                        tags={"task_id": conversation.task_id, "trial": conversation.trial, "turn": turn.index})
        try:
            await ctx.send_body(sample, turn_body(turn, tools, ctx.workload, ctx.plan.agent_max_tokens))
        except ContextTooLong as exc:
            left = len(conversation.turns) - position
            result.notes.append(f"{conversation.label}: turn {turn.index} and the {left - 1} after it skipped, "
                                f"beyond the model's context ({exc})")
            ctx.on_skip(left)
            return
        result.samples.append(sample)


async def run_history(ctx: Context) -> ScenarioResult:
    """Distinct synthetic conversations on one tool group (history.HistoryChats: `history_window`
    live at once, each request a turn of one picked at random), until the prompt tokens sent reach
    `history_tokens`. After every tenth of them the server's /metrics is read: RSS, conversation
    records, KV blocks. The KV pool is allocated up front and every record lives in it, so once the
    pool is warm RSS stays flat however much history goes through; records are evicted instead."""
    name, plan = "history", ctx.plan
    group = ctx.workload.group("history", plan.history_tools)
    chats = HistoryChats(ctx.workload.run_id, window=plan.history_window, turns=plan.history_turns,
                         words=plan.history_words)
    result = ScenarioResult(name)
    before = await ctx.client.metrics()
    readings: list[dict[str, Any]] = []
    sent = estimated = cut = 0
    while sent < plan.history_tokens:
        chat = chats.next_turn()
        body = ctx.workload.chat_body(group, chat.messages, plan.history_max_tokens)
        sample = Sample(name, group.label, group.num_tools, 0, "any", False, 0.0,
                        tags={"conversation": chat.number, "turn": chat.turn})
        try:
            await ctx.send_body(sample, body)
        except ContextTooLong as exc:
            if chat.turn == 1:
                return ScenarioResult(name, skipped=f"a conversation's first turn exceeds the model's context: {exc}")
            chats.end(chat)
            cut += 1
            continue
        result.samples.append(sample)
        estimated += sample.prompt_tokens is None and sample.error is None  # a server that sends no usage
        sent += approx_prompt_tokens(body) if sample.prompt_tokens is None else sample.prompt_tokens
        while len(readings) < 10 and sent * 10 >= plan.history_tokens * (len(readings) + 1):
            readings.append(await pool_reading(ctx.client, tokens=sent, requests=len(result.samples)))
    result.details.update(_history_details(plan, result.samples, sent, readings))
    result.details.update(counters_grown(before, await ctx.client.metrics()), pool=await pool_size(ctx.client))
    result.notes += _history_notes(result.details, estimated, cut)
    return result


def _history_details(plan: Plan, samples: list[Sample], sent: int, readings: list[dict[str, Any]]) -> dict[str, Any]:
    rss = [r["rss_mb"] for r in readings if r["rss_mb"] is not None]
    return {"history_tokens": plan.history_tokens, "tokens_sent": sent,
            "conversations": len({s.tags["conversation"] for s in samples}),
            "window": plan.history_window, "turns": plan.history_turns, "words": plan.history_words,
            "tools": plan.history_tools, "max_tokens": plan.history_max_tokens, "readings": readings,
            "rss_first_mb": rss[0] if rss else None, "rss_last_mb": rss[-1] if rss else None,
            "rss_growth_mb": round(rss[-1] - rss[0], 1) if len(rss) >= 2 else None,
            "conversation_records": readings[-1]["conversation_records"] if readings else None}


def _history_notes(details: dict[str, Any], estimated: int, cut: int) -> list[str]:
    notes = []
    if cut:
        notes.append(f"{cut} conversations ended early: a turn exceeded the model's context (lower --history-turns)")
    if estimated:
        notes.append(f"{estimated} responses had no usage: their prompt tokens are estimated (~4 characters a token)")
    if details["rss_first_mb"] is None:
        notes.append("the server exports no process_resident_memory_bytes: RSS not measured")
    return notes


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 2) if numerator and denominator else None


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    run: Callable[[Context], Awaitable[ScenarioResult]]
    planned: Callable[[Plan], int]  # requests it sends, for the progress bar


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("single", run_single, lambda p: 1 + p.requests + max(p.misses - 1, 0) + p.bypass),
    Scenario("toolcount", run_toolcount, lambda p: len(p.tool_counts) * (1 + p.hits_per_count)),
    Scenario("interleaved", run_interleaved, lambda p: p.groups * p.rounds),
    Scenario("restart", run_restart, lambda p: 3),
    Scenario("concurrent", run_concurrent,
             lambda p: len(p.clients) * (1 + p.mixed_groups) + 2 * sum(p.clients) * p.requests_per_client),
    Scenario("compile-overlap", run_compile_overlap, lambda p: 1 + p.alone_hits + 1 + 3),  # ~3 hits during
    Scenario("soak", run_soak, lambda p: p.soak_requests),
    Scenario("agent", run_agent, lambda p: p.agent_turns),
    Scenario("history", run_history, lambda p: expected_requests(p.history_tokens, tools=p.history_tools,
                                                                 turns=p.history_turns, words=p.history_words)),
    Scenario("constrained", run_constrained, lambda p: p.constrained_requests),
    Scenario("fleet", run_fleet, fleet_planned),
)}
assert tuple(SCENARIOS) == SCENARIO_NAMES  # the command line lists them without importing this module
