"""The prefix store as the cache routes and the CLI change it, with the engine running: the RAM
part (entries, LRU order, in-use counts, block references) on the engine's thread between steps
(`Engine.call`), then the disk and pin-file part on the caller's thread, so the engine never
waits for a file and nothing else touches what it owns (kvcache/store.py says which is which).

Every method blocks: a route runs it on a worker thread (`asyncio.to_thread`), as it ran the
store's own methods before. A change the engine's queue has no room for is a 429."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from gateway.engine import Engine, QueueFull
from gateway.errors import Overloaded
from gateway.kvcache.store import EntryInfo, PrefixStore

T = TypeVar("T")
_POLL_S = 1.0  # how often a wait on the engine checks that it still runs


class StoreAdmin:
    def __init__(self, engine: Engine, store: PrefixStore) -> None:
        self.engine = engine
        self.store = store

    def entries(self) -> list[EntryInfo]:
        """Every entry in any tier, most recently used first."""
        return self.store.entries_with(self._ram())

    def find(self, digest: str) -> EntryInfo | None:
        return self.store.find_with(self._ram(), digest)

    def pin(self, digest: str, budget_bytes: int) -> EntryInfo | None:
        """`PrefixStore.pin_with`, given the RAM tier as the engine has it now."""
        return self.store.pin_with(self._ram(), digest, budget_bytes)

    def unpin(self, digest: str) -> EntryInfo | None:
        self.store.pins.unpin(digest)
        return self.find(digest)

    def remove(self, digest: str) -> bool:
        """Drop the entry from RAM (engine), then its file and pin (here)."""
        in_ram = self.on_engine(lambda: self.store.drop_from_ram(digest))
        return self.store.drop_from_disk(digest) or in_ram

    def clear(self) -> int:
        """Drop every entry not in use, and every file and pin; how many distinct entries went."""
        return self.store.clear_disk(self.on_engine(self.store.clear_ram))

    def on_engine(self, fn: Callable[[], T]) -> T:
        """`fn()` on the engine's thread; here when the engine does not run (before its start,
        after its stop: then nothing else changes the store)."""
        if not self.store.owner.held_elsewhere():
            return fn()
        try:
            future: Future[T] = self.engine.call(fn)
        except QueueFull:
            raise Overloaded("the server is busy: too many requests are queued; retry shortly",
                             headers={"Retry-After": "1"}) from None
        while True:
            try:
                return future.result(timeout=_POLL_S)
            except TimeoutError:
                if not self.store.owner.held_elsewhere() and future.cancel():  # it stopped meanwhile
                    return fn()

    def _ram(self) -> list[EntryInfo]:
        return self.on_engine(self.store.ram_entries)
