"""The five scenarios. Each sends requests through a `Context` and returns a `ScenarioResult`;
the classes (hit / miss / bypass) come from the server's `cached_tokens`, never from the plan.

1 single       one tool group, different questions; extra misses on fresh groups; bypass requests
2 toolcount    one group per tool count (5/10/20/50), skipping counts beyond the model's context
3 interleaved  K groups sent A, B, C, A, B, C ... (a one-slot cache misses every time here)
4 restart      warm a group, restart the server, ask again (the disk tier should make it a hit)
5 concurrent   C clients at once on one warm group
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.bench.client import BenchClient, ContextTooLong, Expected, Sample
from gateway.bench.options import SCENARIO_NAMES
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
    clients: int = 4
    requests_per_client: int = 2

    @classmethod
    def quick(cls, tools: int = 10) -> Plan:
        return cls(tools=tools, tool_counts=(5, 10, 20), hits_per_count=1, requests=3, misses=1, bypass=1,
                   groups=2, rounds=2, clients=2, requests_per_client=1)


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

    async def send(self, scenario: str, group: ToolGroup, expected: Expected, *, bypass: bool = False,
                   **tags: Any) -> Sample:
        sample = Sample(scenario, group.label, group.num_tools, group.offset, expected, bypass, 0.0, tags=tags)
        await self.client.chat(self.workload.body(group), sample)
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


async def run_concurrent(ctx: Context) -> ScenarioResult:
    name, plan = "concurrent", ctx.plan
    result = ScenarioResult(name)
    group = ctx.workload.group("shared", plan.tools)
    result.samples.append(await ctx.send(name, group, "miss", phase="warm"))

    async def one_client(client_id: int) -> list[Sample]:
        return [await ctx.send(name, group, "hit", client=client_id) for _ in range(plan.requests_per_client)]

    started = time.perf_counter()
    batches = await asyncio.gather(*(one_client(c) for c in range(plan.clients)))
    wall_s = time.perf_counter() - started
    burst = [s for batch in batches for s in batch]
    result.samples += burst
    tokens = sum(s.completion_tokens or 0 for s in burst)
    result.details.update(clients=plan.clients, requests_per_client=plan.requests_per_client,
                          wall_s=round(wall_s, 3), requests_per_s=round(len(burst) / wall_s, 3),
                          completion_tokens_per_s=round(tokens / wall_s, 2))
    return result


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
    Scenario("concurrent", run_concurrent, lambda p: 1 + p.clients * p.requests_per_client),
)}
assert tuple(SCENARIOS) == SCENARIO_NAMES  # the command line lists them without importing this module
