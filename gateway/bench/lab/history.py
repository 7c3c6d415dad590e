"""The history scenario: what it sends and reads, many distinct synthetic conversations on one tool
group and the server's pool as its /metrics and dashboard stats describe it, and its run.

Turn k of a conversation is the group (system message and tools, the only text conversations
share), then k user messages with the same short assistant reply between them. The reply is fixed
rather than the model's, so every run sends the same text whatever the model answers. Each user
message opens with its conversation's number, then `words` words drawn by a generator seeded with
(run, conversation, turn): no two conversations share a token after the group.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass, field
from typing import Any

from gateway.bench.client import BenchClient, ContextTooLong, Sample
from gateway.bench.context import Context, ScenarioResult
from gateway.bench.lab.plan import LabPlan

ASSISTANT_REPLY = "Noted. Tell me more."
_WORDS = (
    "account", "answer", "april", "balance", "basket", "bill", "booking", "branch", "budget", "cabin", "card",
    "carrier", "cart", "change", "city", "claim", "client", "code", "colour", "contract", "copy", "cost",
    "country", "coupon", "credit", "date", "day", "delay", "delivery", "deposit", "desk", "discount", "document",
    "door", "email", "fare", "fee", "file", "flight", "form", "gate", "guest", "hotel", "invoice", "item",
    "journey", "label", "letter", "limit", "list", "loan", "luggage", "meal", "member", "menu", "message",
    "method", "minute", "month", "name", "note", "number", "office", "order", "owner", "package", "page",
    "parcel", "partner", "pass", "payment", "period", "phone", "plan", "point", "policy", "price", "product",
    "profile", "purchase", "receipt", "record", "refund", "region", "report", "request", "reservation", "return",
    "room", "route", "sale", "schedule", "seat", "service", "shipment", "size", "station", "status", "stock",
    "store", "subscription", "supplier", "table", "tax", "ticket", "time", "total", "train", "transfer", "trip",
    "upgrade", "user", "value", "voucher", "warehouse", "week", "window", "year"
)
# Rough sizes with the default tokenizer, only for the progress bar's request count: a word of
# _WORDS is ~1.03 tokens, a catalog tool ~170 (5 tools: 866 tokens with the system message).
_TOKENS_PER_WORD = 1.03
_TOKENS_PER_TOOL = 170
_TOKENS_PER_TURN = 20  # role markers, the conversation number, the assistant reply


@dataclass(slots=True)
class SyntheticChat:
    number: int
    messages: list[dict[str, str]] = field(default_factory=list)  # after the system message

    @property
    def turn(self) -> int:
        """Turns sent or being sent: the user messages so far."""
        return sum(1 for m in self.messages if m["role"] == "user")

    def add_turn(self, run_id: str, words: int) -> None:
        """The fixed reply to the previous turn (if any), then a new user message."""
        if self.messages:
            self.messages.append({"role": "assistant", "content": ASSISTANT_REPLY})
        rng = random.Random(f"{run_id}/{self.number}/{self.turn + 1}")
        text = f"Conversation {self.number}, message {self.turn + 1}: " + " ".join(rng.choices(_WORDS, k=words))
        self.messages.append({"role": "user", "content": text})


class HistoryChats:
    """The live conversations: `window` at once, the next turn going to one picked at random
    (seeded: every run sends its turns in the same order), so a conversation picked again soon finds its
    record in the pool and one left waiting long may not. A conversation that has sent `turns`
    turns gives its place to a new one."""

    def __init__(self, run_id: str, *, window: int, turns: int, words: int, seed: int = 0) -> None:
        self.run_id = run_id
        self.turns = turns
        self.words = words
        self._rng = random.Random(seed)
        self._numbers = itertools.count()
        self.live = [self._new() for _ in range(window)]

    def next_turn(self) -> SyntheticChat:
        """A live conversation, picked at random, with its next turn appended."""
        slot = self._rng.randrange(len(self.live))
        if self.live[slot].turn >= self.turns:
            self.live[slot] = self._new()
        chat = self.live[slot]
        chat.add_turn(self.run_id, self.words)
        return chat

    def end(self, chat: SyntheticChat) -> None:
        """Replace `chat` (its last turn did not fit the model's context) with a new conversation."""
        self.live[self.live.index(chat)] = self._new()

    def _new(self) -> SyntheticChat:
        return SyntheticChat(next(self._numbers))


def expected_requests(history_tokens: int, *, tools: int, turns: int, words: int) -> int:
    """About how many requests carry `history_tokens` prompt tokens (for the progress bar)."""
    group = tools * _TOKENS_PER_TOOL
    mean_turns = (turns + 1) / 2
    per_request = group + mean_turns * (words * _TOKENS_PER_WORD + _TOKENS_PER_TURN)
    return max(1, round(history_tokens / per_request))


def approx_prompt_tokens(body: dict[str, Any]) -> int:
    """A prompt's size when the server reports no usage: ~4 characters a token."""
    return len(json.dumps([body.get("messages"), body.get("tools")])) // 4


POOL_SERIES = {"conversation_records": "toolkv_conversation_records",
               "kv_blocks_used": 'toolkv_kv_blocks{state="used"}',
               "kv_blocks_cached": 'toolkv_kv_blocks{state="cached"}'}
COUNTERS = {"conversation_evictions": "toolkv_conversation_evictions_total",
            "conversation_hit_tokens": "toolkv_conversation_hit_tokens_total"}


async def pool_reading(client: BenchClient, *, tokens: int, requests: int) -> dict[str, Any]:
    """The server's RSS, conversation records and KV blocks now (None where /metrics says nothing)."""
    metrics = await client.metrics()
    rss = metrics.get("process_resident_memory_bytes")
    reading: dict[str, Any] = {"tokens": tokens, "requests": requests,
                               "rss_mb": None if rss is None else round(rss / 1e6, 1)}
    for key, series in POOL_SERIES.items():
        reading[key] = _whole(metrics.get(series))
    return reading


def counters_grown(before: dict[str, float], after: dict[str, float]) -> dict[str, int | None]:
    """How much each conversation counter grew over the run (None: the server has no such counter)."""
    return {key: None if series not in after else round(after[series] - before.get(series, 0.0))
            for key, series in COUNTERS.items()}


async def pool_size(client: BenchClient) -> dict[str, int | None]:
    """The KV pool: blocks and tokens from toolkv's dashboard stats, bytes from the bytes per token
    of a tool group held in RAM (the pool is allocated up front, so this is its whole size)."""
    stats = await client.get_json("/v1/dashboard/stats")
    engine = (stats or {}).get("engine") or {}
    blocks = (engine.get("kv_blocks") or {})
    total, block_tokens = _whole(blocks.get("total")), _whole(blocks.get("block_tokens"))
    tokens = total * block_tokens if total and block_tokens else None
    held = [g for g in (stats or {}).get("groups") or () if g.get("num_tokens") and g.get("num_bytes")]
    per_token = held[0]["num_bytes"] / held[0]["num_tokens"] if held else None
    return {"blocks": total, "block_tokens": block_tokens, "tokens": tokens,
            "bytes": round(tokens * per_token) if tokens and per_token else None}


def _whole(value: Any) -> int | None:
    return None if value is None else round(float(value))


async def run_history(ctx: Context, plan: LabPlan) -> ScenarioResult:
    """Distinct synthetic conversations on one tool group (history.HistoryChats: `history_window`
    live at once, each request a turn of one picked at random), until the prompt tokens sent reach
    `history_tokens`. After every tenth of them the server's /metrics is read: RSS, conversation
    records, KV blocks. The KV pool is allocated up front and every record lives in it, so once the
    pool is warm RSS stays flat however much history goes through; records are evicted instead."""
    name = "history"
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


def _history_details(plan: LabPlan, samples: list[Sample], sent: int, readings: list[dict[str, Any]]) -> dict[str, Any]:
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
