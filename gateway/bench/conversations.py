"""The conversation scenarios: agent (recorded tau-bench conversations replayed turn by turn, each
turn the whole conversation so far) and history (synthetic conversations through the KV pool, the
server's RSS read every 10%).
"""

from __future__ import annotations

from typing import Any

from gateway.bench.client import ContextTooLong, Sample
from gateway.bench.context import Context, Plan, ScenarioResult
from gateway.bench.lab.history import HistoryChats, approx_prompt_tokens, counters_grown, pool_reading, pool_size
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
