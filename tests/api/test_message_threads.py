"""The message-thread store (gateway/api/threads.py), model-free: per tenant, least recently used
first out past the count and byte budgets, all tenants bounded together (the largest tenant pays),
a thread forgotten `ttl_s` after its last use, a continuation replacing the thread it continued,
and a record kept without its breakpoints."""

from __future__ import annotations

import orjson
import pytest

from gateway.api.threads import ThreadStore, threaded
from gateway.protocol.messages import MessagesRequest

pytestmark = pytest.mark.model_free  # no model, no server: in the fast subset


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(size: int) -> bytes:
    return b"x" * size


def test_least_recently_used_threads_leave_first_past_the_count_and_the_bytes():
    store = ThreadStore(max_per_tenant=3, max_bytes_per_tenant=100, max_bytes=1000)
    for name in "abc":
        assert store.put("t", name, record(10))
    assert store.get("t", "a") is not None  # a is now the most recently used
    store.put("t", "d", record(10))
    assert [store.get("t", n) is not None for n in "abcd"] == [True, False, True, True]
    store.put("t", "e", record(85))  # c, a, d, then e: 115 bytes > 100, so c and a go
    assert [n for n in "acde" if store.get("t", n) is not None] == ["d", "e"] and store.num_bytes == 95


def test_a_thread_larger_than_a_budget_is_not_kept():
    store = ThreadStore(max_per_tenant=3, max_bytes_per_tenant=50, max_bytes=1000)
    assert not store.put("t", "a", record(51)) and len(store) == 0 and store.num_bytes == 0


def test_past_the_total_the_tenant_holding_the_most_loses_its_oldest():
    store = ThreadStore(max_per_tenant=10, max_bytes_per_tenant=100, max_bytes=120)
    store.put("big", "b1", record(40))
    store.put("big", "b2", record(40))
    store.put("small", "s1", record(30))  # 110
    store.put("small", "s2", record(20))  # 130 > 120: big (80) loses b1
    assert [store.get(t, n) is not None for t, n in [("big", "b1"), ("big", "b2"), ("small", "s1"),
                                                     ("small", "s2")]] == [False, True, True, True]
    assert store.num_bytes == 90


def test_a_thread_expires_its_ttl_after_its_last_use():
    clock = Clock()
    store = ThreadStore(max_per_tenant=10, max_bytes_per_tenant=100, max_bytes=100, ttl_s=60, clock=clock)
    store.put("t", "a", record(5))
    store.put("t", "b", record(5))
    clock.now = 50
    assert store.get("t", "a") is not None  # renewed until 110
    clock.now = 70
    assert store.get("t", "b") is None and store.get("t", "a") is not None
    clock.now = 200
    assert store.get("t", "a") is None and store.num_bytes == 0


def test_a_continuation_replaces_the_thread_it_continued_and_tenants_are_apart():
    store = ThreadStore(max_per_tenant=10, max_bytes_per_tenant=100, max_bytes=100)
    store.put("t", "m1", record(10))
    store.put("t", "m2", record(20), replaces="m1")
    assert store.get("t", "m1") is None and store.get("t", "m2") == record(20) and store.num_bytes == 20
    assert store.get("other", "m2") is None


def test_a_created_thread_keeps_its_conversation_without_breakpoints():
    marked = {"type": "ephemeral"}
    req = MessagesRequest.model_validate({
        "max_tokens": 5, "thread": {"type": "create"},
        "system": [{"type": "text", "text": "Be brief.", "cache_control": marked}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}, "cache_control": marked}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": marked}]}]})
    store = ThreadStore(max_per_tenant=10, max_bytes_per_tenant=10_000, max_bytes=10_000)
    same, turn = threaded(req, store, "t")
    assert same is req and turn is not None and turn.continues is None
    kept = orjson.loads(turn.record([{"type": "text", "text": "Hello."}]))
    assert b"cache_control" not in orjson.dumps(kept)
    assert kept["messages"] == [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                                {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]}]
    store.put("t", "msg_1", turn.record([{"type": "text", "text": "Hello."}]))
    follow = MessagesRequest.model_validate({"max_tokens": 5, "messages": [{"role": "user", "content": "More"}],
                                             "thread": {"type": "continue", "previous_message_id": "msg_1"}})
    whole, turn = threaded(follow, store, "t")
    assert [m.role for m in whole.messages] == ["user", "assistant", "user"]
    assert whole.tools is not None and whole.tools[0].name == "f" and whole.system is not None
    assert turn is not None and turn.continues == "msg_1"
