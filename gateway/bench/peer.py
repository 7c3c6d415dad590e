"""The peer scenario (`--peer-url`): toolkv and another OpenAI-compatible server (llama.cpp's
llama-server, vLLM, another toolkv) measured side by side with the same requests, the two taking
turns: every body is built once and sent to both, one after the other, the one that goes first
alternating from round to round so neither always meets a machine the other just warmed. Each
server first answers one small request of its own, unmeasured (a first request after start is
the restart scenario's business).

- miss and hit: per group (its own tools and system message, new to both servers) a first request
  (a miss), then repeats with new questions (hits on a server that keeps the prefix);
- decode: one stream at a time asking for a long answer: ms per token after the first;
- clients: for each count, all clients at once on a warm group, each one long answer: aggregate
  output tokens/s over the case's wall time; the same bodies on one server, then on the other.

Both servers get the same messages and tools (`--tools-in-system` writes the tools into the system
message for one whose template drops them); the report sets their prompt token counts side by side.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gateway.bench.client import BenchClient, Expected, Sample
from gateway.bench.context import Context, Peer, Plan, ScenarioResult
from gateway.bench.memory import read_memory
from gateway.bench.workload import ToolGroup, WorkloadError

NAME = "peer"
SERVERS = ("toolkv", "peer")


def planned(plan: Plan) -> int:
    per_server = (1 + plan.peer_groups * (1 + plan.peer_hits) + plan.peer_decode_requests
                  + sum(1 + clients for clients in plan.peer_clients))
    return 2 * per_server


async def run_peer(ctx: Context) -> ScenarioResult:
    if ctx.peer is None:
        ctx.on_skip(planned(ctx.plan))
        return ScenarioResult(NAME, skipped="needs --peer-url: the other server to measure beside this one")
    plan = ctx.plan
    try:
        groups = [ctx.workload.group(f"peer-{k + 1}", plan.tools) for k in range(plan.peer_groups)]
    except WorkloadError as exc:
        ctx.on_skip(planned(plan))
        return ScenarioResult(NAME, skipped=str(exc))
    result = ScenarioResult(NAME, details={"peer_url": ctx.peer.client.base_url, "peer_model": ctx.peer.model,
                                           "cases": []})
    warm_up = ctx.workload.group("peer-warm-up", 1)  # a server's first request pays once for what later ones reuse
    for server in SERVERS:
        result.samples.append(await _send(ctx, server, warm_up, ctx.workload.body(warm_up, 1), "any",
                                          phase="warm-up"))
    turn = 0
    for group in groups:
        result.samples += await _both(ctx, turn, group, "miss", phase="miss")
        for _ in range(plan.peer_hits):
            turn += 1
            result.samples += await _both(ctx, turn, group, "hit", phase="hit")
    for _ in range(plan.peer_decode_requests):
        turn += 1
        result.samples += await _both(ctx, turn, groups[-1], "hit", phase="decode", talk=True,
                                      max_tokens=plan.peer_decode_tokens)
    for index, clients in enumerate(plan.peer_clients):
        warm = ctx.workload.body(groups[-1], 1)
        bodies = [ctx.workload.body(groups[-1], plan.concurrent_max_tokens, talk=True) for _ in range(clients)]
        for server in _order(index):
            samples, wall_s = await _clients(ctx, server, groups[-1], warm, bodies)
            result.samples += samples
            result.details["cases"].append({"server": server, "clients": clients, "wall_s": round(wall_s, 3)})
    result.details["memory"] = {"toolkv": await read_memory(ctx.client), "peer": await read_memory(ctx.peer.client)}
    return result


def _order(turn: int) -> tuple[str, str]:
    return SERVERS if turn % 2 == 0 else (SERVERS[1], SERVERS[0])


async def _both(ctx: Context, turn: int, group: ToolGroup, expected: Expected, *, talk: bool = False,
                max_tokens: int | None = None, **tags: Any) -> list[Sample]:
    """One body, sent to each server in this turn's order."""
    body = ctx.workload.body(group, max_tokens, talk=talk)
    return [await _send(ctx, server, group, body, expected, turn=turn, **tags) for server in _order(turn)]


async def _clients(ctx: Context, server: str, group: ToolGroup, warm: dict[str, Any],
                   bodies: list[dict[str, Any]]) -> tuple[list[Sample], float]:
    """The warm request, then every body at once (a client each); the wall time from the first send
    to the last token."""
    case = f"{server}@{len(bodies)}"
    first = await _send(ctx, server, group, warm, "any", phase="warm", case=case)
    started = time.perf_counter()
    measured = await asyncio.gather(*(_send(ctx, server, group, body, "hit", phase="clients", case=case,
                                            clients=len(bodies), client=c) for c, body in enumerate(bodies)))
    return [first, *measured], time.perf_counter() - started


async def _send(ctx: Context, server: str, group: ToolGroup, body: dict[str, Any], expected: Expected,
                **tags: Any) -> Sample:
    sample = Sample(NAME, group.label, group.num_tools, group.offset, expected, False, 0.0,
                    tags={"server": server, **tags})
    client, sent = _target(ctx, server, body)
    await client.chat(sent, sample)
    ctx.on_sample(sample)
    return sample


def _target(ctx: Context, server: str, body: dict[str, Any]) -> tuple[BenchClient, dict[str, Any]]:
    """The server's client, and the body as it goes there: the peer's model id in place of toolkv's."""
    if server == "toolkv":
        return ctx.client, body
    peer: Peer | None = ctx.peer
    assert peer is not None
    return peer.client, body if peer.model is None else {**body, "model": peer.model}
