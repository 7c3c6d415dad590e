"""Fairness of the prepare threads between API keys: one key's backlog of expensive prepares (big
tool lists, big schemas) delays another key's request by at most one of its running prepares,
never by the whole backlog.

A's prepares are held at a gate the test opens one at a time (the service's own `prepare` runs
once a request passes it), so what is asserted is the order the prepare workers take requests in,
observed as events, never wall-clock time."""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from gateway.edge.admission import Preparer, tenant_salt
from gateway.serving.service import ChatService
from gateway.settings import load_settings
from tests.support.server import serve
from tests.support.waiting import wait_until

KEY_A, KEY_B = "key-alpha-fairness-1", "key-beta-fairness-2"
SALT_A, SALT_B = tenant_salt(KEY_A.encode()), tenant_salt(KEY_B.encode())
BACKLOG = 6  # A's requests; the server has 2 prepare workers
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def keyed(tiny_model_dir, tmp_path_factory):
    settings = load_settings(overrides={
        "model": str(tiny_model_dir("llama")), "min_prefix_tokens": 8, "api_keys": (KEY_A, KEY_B),
        "cache_dir": str(tmp_path_factory.mktemp("cache"))}, environ={})
    with serve(settings) as live:
        yield live


class Gate:
    """Wraps `ChatService.prepare`: records which request's prepare starts, in order, and holds
    key A's until the test lets one through."""

    def __init__(self, prepare: Callable[..., Any]) -> None:
        self._prepare = prepare
        self._permits = threading.Semaphore(0)
        self._changed = threading.Condition()
        self.started: list[str] = []  # each prepare's label (the request's last message), as it starts

    def __call__(self, service: ChatService, req: Any, *args: Any, **kwargs: Any) -> Any:
        with self._changed:
            self.started.append(str(req.messages[-1].content))
            self._changed.notify_all()
        if kwargs.get("tenant") == SALT_A:
            assert self._permits.acquire(timeout=DEADLINE_S), "the test never let this prepare through"
        return self._prepare(service, req, *args, **kwargs)

    def let_through(self, count: int) -> None:
        self._permits.release(count)

    def wait_started(self, count: int) -> list[str]:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.started) >= count, timeout=DEADLINE_S), self.started
            return list(self.started)


def eventually(condition: Callable[[], bool]) -> None:
    """Poll a condition of the server's state (readiness polling: what is awaited is the state)."""
    assert wait_until(condition, DEADLINE_S, interval_s=0.005), "the server never reached the awaited state"


def big_request(label: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    renamed = copy.deepcopy(tools)  # distinct names: no prepare-time state shared between A's requests
    for tool in renamed:
        tool["function"]["name"] += "_" + label.lower()
    return {"messages": [{"role": "system", "content": "You are a merchant assistant."},
                         {"role": "user", "content": label}],
            "tools": renamed, "tool_choice": "none", "max_tokens": 1, "temperature": 0}


@pytest.fixture()
def gate(monkeypatch) -> Iterator[Gate]:
    held = Gate(ChatService.prepare)

    def prepare(service: ChatService, req: Any, *args: Any, **kwargs: Any) -> Any:  # bound like the method
        return held(service, req, *args, **kwargs)

    monkeypatch.setattr(ChatService, "prepare", prepare)
    yield held


def send(live, key: str, payload: dict[str, Any], results: dict[str, int], label: str) -> None:
    resp = httpx.post(live.api_url + "/chat/completions", json=payload, timeout=DEADLINE_S,
                      headers={"Authorization": f"Bearer {key}"})
    results[label] = resp.status_code


def test_one_keys_prepare_backlog_does_not_hold_up_another_keys_request(keyed, gate, merchant_tools):
    preparer: Preparer = keyed.app.state.gateway.preparer
    results: dict[str, int] = {}
    a_labels = [f"A{i}" for i in range(BACKLOG)]
    senders = [threading.Thread(target=send, args=(keyed, KEY_A, big_request(label, merchant_tools[:12]),
                                                   results, label)) for label in a_labels]
    b = threading.Thread(target=send, args=(keyed, KEY_B, {"messages": [{"role": "user", "content": "B"}],
                                                          "max_tokens": 1}, results, "B"))
    for sender in senders:
        sender.start()
    try:
        assert all(label.startswith("A") for label in gate.wait_started(2))  # both workers hold one of A's
        eventually(lambda: preparer.waiting(SALT_A) == BACKLOG - 2)  # the rest of A's backlog queues
        b.start()
        eventually(lambda: preparer.waiting(SALT_B) == 1)  # B's request waits for a worker too
        gate.let_through(1)  # one of A's running prepares finishes: its worker is free
        # B's is the next prepare to start, ahead of the four of A's queued before it ...
        assert gate.wait_started(3)[2] == "B", gate.started
        b.join(DEADLINE_S)
        assert results.get("B") == 200, results
        # ... and it was answered while the rest of A's backlog still waited (one of A's finished, at most)
        still_pending = [label for label in a_labels if label not in results]
        assert len(still_pending) >= BACKLOG - 1, results
        assert preparer.waiting(SALT_A) >= BACKLOG - 4
    finally:
        gate.let_through(BACKLOG)
        for sender in senders:
            sender.join(DEADLINE_S)
    assert results == {**dict.fromkeys(a_labels, 200), "B": 200}
    assert sorted(gate.started) == sorted([*a_labels, "B"])  # every request prepared exactly once


def test_keys_take_turns_on_a_single_prepare_worker():
    """Two keys' backlogs on one worker alternate, each key's own requests in their order."""
    async def scenario() -> list[str]:
        preparer = Preparer(max_pending=64, workers=1)
        hold = threading.Event()
        order: list[str] = []

        def job(label: str) -> Callable[[], str]:
            def run() -> str:
                if label == "first":
                    hold.wait(DEADLINE_S)
                order.append(label)
                return label
            return run

        first = asyncio.ensure_future(preparer.run(job("first"), tenant="a"))
        while preparer.running("a") == 0:  # the worker holds "first"; everything else queues
            await asyncio.sleep(0.001)
        tasks = [asyncio.ensure_future(preparer.run(job(label), tenant=label[0]))
                 for label in ("a1", "a2", "a3", "b1", "b2")]
        await asyncio.sleep(0)  # let every task enqueue (no await inside `run` before it queues)
        hold.set()
        await asyncio.gather(first, *tasks)
        preparer.close()
        return order

    # a1 queued before b1; then the keys alternate, whatever the length of a's backlog
    assert asyncio.run(scenario()) == ["first", "a1", "b1", "a2", "b2", "a3"]


def test_a_cancelled_request_is_never_prepared():
    """A request whose caller went away while it queued (a disconnect cancels the route) never
    takes a prepare worker's time, and frees its place in the queue at once."""
    async def scenario() -> tuple[list[str], int]:
        preparer = Preparer(max_pending=64, workers=1)
        hold = threading.Event()
        ran: list[str] = []

        def blocking() -> None:
            hold.wait(DEADLINE_S)
            ran.append("blocking")

        busy = asyncio.ensure_future(preparer.run(blocking, tenant="a"))
        while preparer.running("a") == 0:
            await asyncio.sleep(0.001)
        doomed = asyncio.ensure_future(preparer.run(lambda: ran.append("doomed"), tenant="b"))
        await asyncio.sleep(0)
        assert preparer.waiting("b") == 1
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        queued_after_cancel = preparer.waiting("b")
        hold.set()
        await busy
        await preparer.run(lambda: ran.append("after"), tenant="b")
        preparer.close()
        return ran, queued_after_cancel

    ran, queued = asyncio.run(scenario())
    assert queued == 0
    assert ran == ["blocking", "after"]
