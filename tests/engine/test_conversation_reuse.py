"""Agent loops compute only what is new (issue 16): the next turn of a conversation starts from
the previous turn's prompt KV, a changed tool list from the cached group's common prefix, and
either way the tokens are exactly those of a plain full prefill (bypass)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from adapters.base import canonical_rank
from gateway.bench.data import TAU_BENCH
from gateway.protocol.chat import ChatCompletionRequest
from gateway.serving.runtime import Runtime
from tests.engine.conftest import generate, not_kept
from tests.engine.test_batching import TINY_KV_BYTES_PER_TOKEN

ARCHS = ["llama", "qwen2", "mistral"]
TAU = TAU_BENCH


def tau_turns(task_id: int = 0, trial: int = 0) -> list[list[dict[str, Any]]]:
    """The message lists an airline agent sent, turn by turn (one real tau-bench trajectory)."""
    rows = [json.loads(line) for line in (TAU / "airline_trajectory_turns.head150.jsonl").open()]
    mine = sorted((r for r in rows if (r["task_id"], r["trial"]) == (task_id, trial)), key=lambda r: r["turn_index"])
    return [r["messages"] for r in mine]


@pytest.fixture(scope="module")
def airline_tools() -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = json.loads((TAU / "tools_airline.json").read_text())
    return tools


def request(messages: list[dict[str, Any]], tools: list[dict[str, Any]], max_tokens: int = 6) -> dict[str, Any]:
    return {"messages": messages, "tools": tools, "temperature": 0, "max_tokens": max_tokens}


def prompt_len(runtime: Runtime, body: dict[str, Any]) -> int:
    return len(runtime.service.prepare(ChatCompletionRequest.model_validate(body)).job.prompt_ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_turn_computes_only_its_new_messages_and_equals_a_full_prefill(runtime_for, airline_tools, arch):
    runtime = runtime_for(arch, context=8192)
    previous = 0
    # Every turn on llama. The other architectures (their own attention, biases, rope) over the first
    # three, which add a user message and a tool result to a cached prompt (each turn's plain prefill
    # computes the whole prompt: the later turns only repeat those two cases, at a cost each).
    turns = tau_turns() if arch == "llama" else tau_turns()[:3]
    for number, messages in enumerate(turns):
        body = request(messages, airline_tools)
        reused = generate(runtime, body)
        plain = generate(runtime, body, bypass=True)
        assert reused.finished.token_ids == plain.finished.token_ids
        prompt = reused.prefilled.prompt_tokens
        if number == 0:
            assert reused.prefilled.result == "miss"
        else:
            assert reused.prefilled.result == "hit"
            # the whole previous prompt, its generation prompt included, was reused, nothing more
            assert reused.prefilled.cached_tokens == previous
        previous = prompt
    assert len(turns) >= (6 if arch == "llama" else 3) and runtime.engine.cache.conversations.evictions == 0


def test_a_turn_reuses_after_its_group_was_evicted_and_recompiled(runtime_for, airline_tools):
    """A record does not depend on its group's entry: the group is recomputed bit for bit."""
    runtime = runtime_for("llama", context=8192)
    first, second = tau_turns()[:2]
    generate(runtime, request(first, airline_tools))
    assert runtime.admin.clear() == 1  # through the engine thread, which owns the store
    body = request(second, airline_tools)
    again = generate(runtime, body)
    group = runtime.store.ram.entries()[0].num_tokens
    assert again.prefilled.result == "miss"  # the group was computed again; the turn after it was not
    turn = prompt_len(runtime, request(first, airline_tools))
    assert again.prefilled.cached_tokens == turn - group
    assert again.finished.token_ids == generate(runtime, body, bypass=True).finished.token_ids


def test_an_edited_earlier_message_reuses_only_the_turns_before_it(runtime_for, airline_tools):
    """Chunks are cut after each assistant turn's opening and blank: an edit reuses up to the cut
    before it."""
    runtime = runtime_for("llama", context=8192)
    messages = tau_turns()[1]
    generate(runtime, request(messages, airline_tools))
    edited = [dict(m) for m in messages]
    assert [m["role"] for m in edited[1:4]] == ["user", "assistant", "user"]
    edited[3]["content"] = "Actually my user ID is noah_muller_9847."  # the second user message
    body = request(edited, airline_tools)
    run = generate(runtime, body)
    first_turn = prompt_len(runtime, request(messages[:2], airline_tools))  # up to the first answer
    assert run.prefilled.cached_tokens == first_turn
    assert run.finished.token_ids == generate(runtime, body, bypass=True).finished.token_ids


@pytest.mark.parametrize("change", ["added", "removed"])
def test_a_tool_list_changed_at_its_end_reuses_the_cached_groups_prefix(runtime_for, merchant_tools, change):
    """Tools are rendered in canonical order: the tool that sorts last changes only the group's end.
    A group is reused up to its last chunk end before the change (128-token chunks here; a GPU's
    default 2048 leaves none inside a group this small)."""
    runtime = runtime_for("llama", prefill_chunk_tokens=128)
    tools = sorted(merchant_tools[:12], key=lambda t: canonical_rank(ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": [t]}).tools[0].to_spec()))
    old, new = (tools[:-1], tools) if change == "added" else (tools, tools[:-1])
    question = [{"role": "system", "content": "You run a shop."}, {"role": "user", "content": "Refund order 7?"}]
    first = generate(runtime, request(question, old))
    group = runtime.store.ram.entries()[0].num_tokens
    body = request(question, new)
    changed = generate(runtime, body)
    assert first.prefilled.result == changed.prefilled.result == "miss"
    assert changed.prefilled.cached_tokens >= 0.85 * group
    assert changed.finished.token_ids == generate(runtime, body, bypass=True).finished.token_ids
    assert generate(runtime, body).prefilled.result == "hit"  # the new group was stored whole


def test_tenants_never_share_conversation_blocks(runtime_for, airline_tools):
    """Two tenants send the same conversation, over a group listed in shared_groups: the group's
    blocks are shared, the conversation's never are (different chain roots, disjoint blocks)."""
    runtime = runtime_for("llama", context=8192)
    first, second = tau_turns()[:2]
    for tenant in ("tenant-a", "tenant-b"):
        generate(runtime, request(first, airline_tools), tenant=tenant, shared=True)
    other = generate(runtime, request(second, airline_tools), tenant="tenant-b", shared=True)
    mine = generate(runtime, request(second, airline_tools), tenant="tenant-a", shared=True)
    group = runtime.store.ram.entries()[0].num_tokens
    assert len(runtime.store.ram.entries()) == 1  # the shared group
    assert mine.prefilled.cached_tokens == other.prefilled.cached_tokens > group
    records = runtime.engine.cache.conversations.records()
    assert len(records) == 2
    a, b = records
    assert a.tokens == b.tokens  # the same text...
    assert set(a.run.block_ids).isdisjoint(b.run.block_ids)  # ...in blocks of their own
    assert not set(a.hashes) & set(b.hashes)  # and chains that never meet
    stranger = generate(runtime, request(second, airline_tools), tenant="tenant-c", shared=True)
    assert stranger.prefilled.cached_tokens == group  # the group only: no one else's conversation


def _conversations(count: int) -> Iterator[list[dict[str, Any]]]:
    for index in range(count):
        yield [{"role": "system", "content": "You are a helpful shop assistant."},
               {"role": "user", "content": f"Conversation {index}: " + f"tell me about order {index}. " * 30}]


def test_conversation_records_live_in_the_pool_and_give_way_to_new_requests(runtime_for, merchant_tools):
    """Far more history than the pool holds: the oldest records are dropped to make room, every
    request is served, and the blocks in use never exceed the pool."""
    runtime = runtime_for("llama", ram_budget_bytes=TINY_KV_BYTES_PER_TOKEN * 4000)
    pool, conversations = runtime.engine.pool, runtime.engine.cache.conversations
    served = 0
    for messages in _conversations(30):
        body = request(messages, merchant_tools[:3], max_tokens=4)
        run = generate(runtime, body)
        served += run.prefilled.prompt_tokens
        assert pool.num_used <= pool.num_blocks
    assert served > 3 * pool.num_blocks * pool.block_tokens  # three pools' worth of prompts went through
    assert conversations.evictions > 0 and len(conversations) < 30
    assert not_kept(runtime) == sum(pool.blocks_for(e.num_tokens) for e in runtime.store.ram.entries())
    # the latest conversation is still there to continue
    last = list(_conversations(30))[-1]
    follow = [*last, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "And order 3?"}]
    run = generate(runtime, request(follow, merchant_tools[:3], max_tokens=4))
    assert run.prefilled.cached_tokens > prompt_len(runtime, request(last, merchant_tools[:3])) - 8
