"""Forced tokens per call: how many of the tokens of a scenario's tool calls the server's grammar
forced (toolkv feeds them to the model as one chunk instead of a decode step each: docs/engine.md,
"Forced tokens in one step"), from `toolkv_forced_tokens_total` around the scenario and the calls
its answers made. None where the server does not export the counter (a peer) or made no call."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gateway.bench.client import Sample
from gateway.bench.context import Context, ScenarioResult

FORCED_SERIES = "toolkv_forced_tokens_total"
Run = Callable[[Context], Awaitable[ScenarioResult]]


def with_forced_tokens(run: Run) -> Run:
    """`run`, its result's details given `forced` (`forced_tokens`)."""
    async def measured(ctx: Context) -> ScenarioResult:
        before = await ctx.client.metrics()
        result = await run(ctx)
        result.details["forced"] = forced_tokens(before, await ctx.client.metrics(), result.samples)
        return result
    return measured


def forced_tokens(before: dict[str, float], after: dict[str, float], samples: list[Sample]) -> dict[str, Any]:
    tokens = round(after[FORCED_SERIES] - before.get(FORCED_SERIES, 0.0)) if FORCED_SERIES in after else None
    calls = sum(s.tool_calls for s in samples)
    per_call = round(tokens / calls, 1) if tokens is not None and calls else None
    return {"tokens": tokens, "calls": calls, "per_call": per_call}


def forced_lines(scenarios: dict[str, dict[str, Any]]) -> list[str]:
    """One line: forced tokens per call in each scenario that counted them."""
    parts = [f"{name} {f['per_call']} over {f['calls']} calls" if f.get("per_call") is not None
             else f"{name} {f.get('tokens')} tokens, {f.get('calls')} calls"
             for name, data in scenarios.items() if (f := data.get("forced")) and not data.get("skipped")]
    return [f"forced tokens per tool call (one chunk each, not a step per token): {'; '.join(parts)}"] if parts else []
