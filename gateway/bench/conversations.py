"""The agent scenario: recorded tau-bench conversations replayed turn by turn, each turn the whole
conversation so far (the lab's history scenario sends synthetic ones: lab/history.py).
"""

from __future__ import annotations

from typing import Any

from gateway.bench.client import ContextTooLong, Sample
from gateway.bench.context import Context, ScenarioResult
from gateway.bench.trajectories import Conversation, turn_body


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
