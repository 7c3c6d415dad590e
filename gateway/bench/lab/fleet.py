"""The fleet scenario (runs only when named): toolkv on N replicas behind one ingress
(`toolkv serve --replicas N`), measured from outside: hits and TTFT from the ingress's answers,
where each request went from the growth of its `toolkv_upstream_routed_total{upstream,route}`, and
where a group compiled from the growth of the replicas' `toolkv_cache_lookups_total{result="miss",
replica}` (the ingress's /metrics carries every replica's series with a `replica` label).

interleaved  `fleet_groups` groups (distinct tool slices of the catalog) x `fleet_rounds` rounds,
             one request at a time, /metrics read after each: every request after a group's first
             should hit, and each group compile once, on one replica. Round r starts at group r
             (ABCD BCDA ...): in a fixed order of as many groups as a multiple of the replicas,
             round robin would send each group to the same replica every time.
hot          `fleet_clients` clients on one group, in rounds: every client sends one request and
             holds its stream after the first token until all have theirs, so the requests are in
             flight together and routing sees them all (a first round warms, not measured). With
             the ingress's `upstream_max_in_flight` at half the clients (what --spawn sets), the
             home takes half and the rest spill to the group's second replica.
balanced     the same rounds, each client on a group of its own, picked so that their homes (ranked
             here with the ingress's own router) split evenly over the replicas; each group warmed
             once first. Target: hot hit TTFT p95 at most 2x balanced.
baseline     interleaved again on a second fleet routed round robin with a cache per replica
             (`--baseline-url`, or spawned in the main fleet's place with --spawn).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from adapters.base import ToolGroup as PromptGroup
from adapters.base import ToolSpec
from gateway.bench.client import BenchClient, Expected, Sample
from gateway.bench.context import Context, ScenarioResult
from gateway.bench.lab.baselines import BaselineFleet
from gateway.bench.lab.fleet_metrics import (
    ROUTED,
    Metrics,
    compiles,
    grown,
    has_replica_series,
    replica_name,
    spread,
    upstreams_of,
)
from gateway.bench.lab.plan import LabPlan
from gateway.bench.server import ServerFailed
from gateway.bench.workload import ToolGroup, WorkloadError
from gateway.edge.admission import tenant_salt as key_salt
from gateway.proxy.routing import AffinityRouter, affinity_key

MAX_CANDIDATES = 64  # groups ranked to find the balanced case's even split (each home is a coin toss)


def planned(plan: LabPlan) -> int:
    """Requests the scenario sends (baseline included), for the progress bar."""
    sequence = plan.fleet_groups * plan.fleet_rounds
    return 2 * sequence + plan.fleet_clients * (2 + 2 * plan.fleet_requests_per_client)


async def run_fleet(ctx: Context, plan: LabPlan, fleet_baseline: BaselineFleet | None) -> ScenarioResult:
    name = "fleet"
    upstreams = upstreams_of(await ctx.client.metrics())
    if len(upstreams) < 2:
        ctx.on_skip(planned(plan))
        return ScenarioResult(name, skipped="needs 2 or more replicas behind one ingress (`toolkv serve --replicas "
                                            "2`, or --spawn --replicas 2); the server's /metrics names "
                                            f"{len(upstreams)} upstreams")
    result = ScenarioResult(name, details={
        "replicas": [replica_name(u) for u in upstreams], "groups": plan.fleet_groups, "rounds": plan.fleet_rounds,
        "clients": plan.fleet_clients, "requests_per_client": plan.fleet_requests_per_client})
    try:
        result.samples += await interleave(ctx, plan, ctx.client, "interleaved", "")
        result.samples += await hot_group(ctx, plan, result.details)
        result.samples += await balanced(ctx, plan, upstreams, result.details)
    except WorkloadError as exc:
        ctx.on_skip(planned(plan) - len(result.samples))
        return ScenarioResult(name, skipped=str(exc))
    result.samples += await baseline(ctx, plan, fleet_baseline, result.details)
    if not any(s.tags.get("compiled_on") is not None for s in result.samples):
        result.notes.append("the ingress's /metrics has no replica-labelled series: compiles per replica unknown")
    return result


async def interleave(ctx: Context, plan: LabPlan, client: BenchClient, part: str, prefix: str) -> list[Sample]:
    """`fleet_groups` groups x `fleet_rounds` rounds, one request at a time, round r starting at
    group r; each sample tagged with the replicas it was routed to and those that compiled."""
    tools = ctx.plan.tools
    groups = [ctx.workload.group(f"{prefix}{chr(ord('A') + k)}", tools, offset=k * tools)
              for k in range(plan.fleet_groups)]
    samples = []
    before = await client.metrics()
    for round_index in range(plan.fleet_rounds):
        for k in range(len(groups)):
            group = groups[(round_index + k) % len(groups)]
            expected: Expected = "miss" if round_index == 0 else "hit"
            sample = await send(ctx, client, part, group, expected, round=round_index)
            before = await watch(client, sample, before)
            samples.append(sample)
    return samples


async def hot_group(ctx: Context, plan: LabPlan, details: dict[str, Any]) -> list[Sample]:
    clients = [ctx.workload.group("hot", ctx.plan.tools)] * plan.fleet_clients
    before = await ctx.client.metrics()
    samples = await in_rounds(ctx, "hot", clients, 1, "warm")
    warmed = await ctx.client.metrics()
    samples += await in_rounds(ctx, "hot", clients, plan.fleet_requests_per_client, "measure")
    details["hot"] = {"warm": spread(before, warmed), "measure": spread(warmed, await ctx.client.metrics())}
    return samples


async def balanced(ctx: Context, plan: LabPlan, upstreams: tuple[str, ...], details: dict[str, Any]) -> list[Sample]:
    """Groups whose homes split evenly, each warmed on its own, then the clients' rounds."""
    homes = balanced_groups(ctx, upstreams, plan.fleet_clients)
    groups = [ctx.workload.group(label, ctx.plan.tools) for label in homes]
    samples = []
    before = await ctx.client.metrics()
    for group in groups:
        sample = await send(ctx, ctx.client, "balanced", group, "miss", max_tokens=1, phase="warm")
        before = await watch(ctx.client, sample, before)
        samples.append(sample)
    samples += await in_rounds(ctx, "balanced", groups, plan.fleet_requests_per_client, "measure")
    details["balanced"] = {"homes": {label: replica_name(home) for label, home in homes.items()},
                           "measure": spread(before, await ctx.client.metrics())}
    return samples


async def baseline(ctx: Context, plan: LabPlan, fleet: BaselineFleet | None, details: dict[str, Any]) -> list[Sample]:
    """The interleaved part again on the round-robin fleet, on groups of its own."""
    if fleet is None:
        ctx.on_skip(plan.fleet_groups * plan.fleet_rounds)
        details["baseline"] = {"skipped": "no baseline fleet: pass --baseline-url (a fleet started with "
                                          "--upstream-routing round_robin --replica-cache separate), or use --spawn"}
        return []
    details["baseline"] = {"skipped": None, "fleet": fleet.description}
    try:
        return await baseline_run(ctx, plan, await fleet.start(), details["baseline"])
    except ServerFailed as exc:
        ctx.on_skip(plan.fleet_groups * plan.fleet_rounds)
        details["baseline"]["skipped"] = str(exc)
        return []
    finally:
        await fleet.stop()


async def baseline_run(ctx: Context, plan: LabPlan, url: str, out: dict[str, Any]) -> list[Sample]:
    client = ctx.client.sibling(url)
    try:
        before = await client.metrics()
        upstreams = upstreams_of(before)
        out["replicas"] = [replica_name(u) for u in upstreams]
        if len(upstreams) < 2:
            ctx.on_skip(plan.fleet_groups * plan.fleet_rounds)
            out["skipped"] = f"the baseline at {url} is no fleet: its /metrics names {len(upstreams)} upstreams"
            return []
        samples = await interleave(ctx, plan, client, "baseline", "RR-")
        out["routes"] = grown(before, await client.metrics(), ROUTED, "route")
        return samples
    finally:
        await client.aclose()


async def in_rounds(ctx: Context, part: str, groups: list[ToolGroup], rounds: int, phase: str) -> list[Sample]:
    """`rounds` rounds; in each, client c sends one request on groups[c], all at once, each stream
    held after its first token until every one has its first token (or failed)."""
    samples = []
    for round_index in range(rounds):
        gate = FirstTokens(len(groups))
        samples += await asyncio.gather(*(gated(ctx, part, group, gate, phase=phase, round=round_index, client=c)
                                          for c, group in enumerate(groups)))
    return samples


class FirstTokens:
    """Releases the streams of a round once each has its first token (or failed)."""

    def __init__(self, count: int) -> None:
        self._left = count
        self._all = asyncio.Event()

    def arrive(self) -> None:
        self._left -= 1
        if self._left <= 0:
            self._all.set()

    async def hold(self) -> None:
        self.arrive()
        await self._all.wait()


async def gated(ctx: Context, part: str, group: ToolGroup, gate: FirstTokens, **tags: Any) -> Sample:
    held = False

    async def hold() -> None:
        nonlocal held
        held = True
        await gate.hold()

    try:
        return await send(ctx, ctx.client, part, group, "hit", on_first_token=hold, **tags)
    finally:
        if not held:
            gate.arrive()


async def send(ctx: Context, via: BenchClient, part: str, group: ToolGroup, expected: Expected, *,
               max_tokens: int | None = None, on_first_token: Callable[[], Awaitable[None]] | None = None,
               **tags: Any) -> Sample:
    sample = Sample("fleet", group.label, group.num_tools, group.offset, expected, False, 0.0,
                    tags={"part": part, **tags})
    await via.chat(ctx.workload.body(group, max_tokens), sample, on_first_token=on_first_token)
    ctx.on_sample(sample)
    return sample


async def watch(client: BenchClient, sample: Sample, before: Metrics) -> Metrics:
    """Tag `sample` with where it went and who compiled, from /metrics now against `before`."""
    after = await client.metrics()
    sample.tags["routed_to"] = [replica_name(u) for u in grown(before, after, ROUTED, "upstream")]
    sample.tags["compiled_on"] = list(compiles(before, after)) if has_replica_series(after) else None
    return after


def balanced_groups(ctx: Context, upstreams: tuple[str, ...], count: int) -> dict[str, str]:
    """`count` group labels -> their homes, as evenly spread over the upstreams as the first
    `MAX_CANDIDATES` candidates allow."""
    router = AffinityRouter(upstreams, max_in_flight=1)
    salt = tenant_salt(ctx.client.api_key)
    per_home = -(-count // len(upstreams))
    picked: dict[str, str] = {}
    for index in range(MAX_CANDIDATES):
        label = f"balanced-{index}"
        body = ctx.workload.chat_body(ctx.workload.group(label, ctx.plan.tools), [])
        home = router.ranking(affinity_key(salt, group_id(body)))[0]
        if sum(h == home for h in picked.values()) < per_home:
            picked[label] = home
        if len(picked) == count:
            break
    return picked


def group_id(body: dict[str, Any]) -> str:
    """The tool group the ingress routes `body` by (gateway.proxy.shaping's: the leading system
    messages and the tools)."""
    system = [m["content"] for m in body["messages"] if m["role"] == "system"]
    specs = [ToolSpec(t["function"]["name"], t["function"].get("description"), t["function"].get("parameters"))
             for t in body.get("tools", [])]
    return PromptGroup.of("\n\n".join(system) if system else None, specs).group_id


def tenant_salt(api_key: str | None) -> str:
    """The salt the ingress routes a key's groups by: "" on an open gateway (gateway.edge.admission)."""
    return "" if api_key is None else key_salt(api_key.encode())
