"""One owner for the prefix store (kvcache/block_pool.py's `Owner`): while the engine's thread runs, the RAM tier
and the KV pool's block counts change on it alone; a change from any other thread raises at once,
and the disk writer's blocks are handed back for the owner to release."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from gateway.kvcache.block_pool import BlockPool, PoolShape, RamTier, WrongThread
from gateway.kvcache.store import PrefixStore
from tests.kvcache.entries import make_entry

pytestmark = pytest.mark.model_free  # no model, no server: in the fast subset


class OwnerLoop:
    """A stand-in for the engine's loop: runs the functions it is given, in order, on its thread."""

    def __init__(self) -> None:
        self._calls: queue.Queue[tuple[Future[Any], Callable[[], Any]] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="owner", daemon=True)

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._calls.put((future, fn))
        return future

    def stop(self) -> None:
        self._calls.put(None)
        self.thread.join()

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            future, fn = item
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)


@pytest.fixture
def loop() -> Iterator[OwnerLoop]:
    running = OwnerLoop()
    yield running
    if running.thread.is_alive():
        running.stop()


def _pool() -> BlockPool:
    return BlockPool(PoolShape(1, 1, 2, torch.float32), 16 * 4 * 8, 4, torch.device("cpu"))  # 8 blocks


def test_a_change_off_the_owner_thread_raises_while_the_owner_runs(loop: OwnerLoop) -> None:
    store, pool = PrefixStore(RamTier(1 << 20)), _pool()
    for owned in (store.owner, pool.owner):
        owned.bind(loop.thread, loop.call)
    entry = make_entry(list(range(100, 116)))
    store.insert(entry)  # not started yet: start-up (warm-up) changes it from its own thread
    loop.thread.start()
    with pytest.raises(WrongThread):
        store.drop_from_ram(entry.key.digest)
    with pytest.raises(WrongThread):
        pool.allocate(4)
    assert loop.call(lambda: store.drop_from_ram(entry.key.digest)).result(timeout=30) is True
    assert loop.call(lambda: pool.allocate(4) is not None).result(timeout=30)
    loop.stop()
    store.insert(entry)  # stopped: shutdown may change it again
    assert [info.digest for info in store.ram_entries()] == [entry.key.digest]


def test_blocks_handed_back_by_another_thread_are_released_by_the_owner(loop: OwnerLoop) -> None:
    pool = _pool()
    pool.owner.bind(loop.thread, loop.call)
    loop.thread.start()
    run = loop.call(lambda: pool.allocate(8)).result(timeout=30)
    loop.call(run.retain).result(timeout=30)  # a second holder: the disk writer's reference
    writer = threading.Thread(target=pool.release_later, args=(run,))
    writer.start()
    writer.join()
    # the hand-back asked the owner to reclaim before this call was queued: it has run by now
    assert loop.call(lambda: (pool.refs(run.first), pool.num_used)).result(timeout=30) == (1, 2)
