"""The one thread that changes the prefix store's in-memory state (the RAM tier's entries, LRU order
and in-use counts) and the KV pool's block references: the engine's, once it runs.

Before the engine's thread starts (start-up, warm-up) and after it ends (shutdown), or with no
engine at all (the CLI, model-free tests), whoever holds the store is its only user and may change
it. While the engine runs, a change from any other thread is a bug, and `check` raises at once
(tests/kvcache/test_owner.py; tests/kvcache/test_cache_api.py shows the routes' changes run on the
engine's thread): that is what lets the RAM tier and the block pool go without locks. Other
threads hand work to the owner instead: routes through `engine.call` (serving/store_admin.py),
the disk writer by handing block runs back (`BlockPool.release_later`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

Submit = Callable[[Callable[[], Any]], Any]  # runs a function on the owner's thread, soon (Engine.call)


class WrongThread(RuntimeError):
    """The store or the pool was changed off its owner's thread while the owner runs."""


class Owner:
    __slots__ = ("_submit", "_thread")

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._submit: Submit | None = None

    def bind(self, thread: threading.Thread, submit: Submit | None = None) -> None:
        """`thread` owns from when it starts until it ends; `submit` runs a function on it."""
        self._thread, self._submit = thread, submit

    def held_elsewhere(self) -> bool:
        """Whether the owner runs now and this is not its thread."""
        thread = self._thread
        return thread is not None and thread.ident != threading.get_ident() and thread.is_alive()

    def check(self) -> None:
        """Raise WrongThread unless this thread may change what the owner owns (a cheap compare)."""
        if self.held_elsewhere():
            raise WrongThread(f"changed on thread {threading.current_thread().name!r} while "
                              f"{self._thread.name if self._thread else '?'!r} owns it: use engine.call")

    def soon(self, fn: Callable[[], Any]) -> bool:
        """Ask the owner to run `fn` between its steps; False when there is no running owner to
        ask, or it would not take it (its queue is full)."""
        if self._submit is None or not self.held_elsewhere():
            return False
        try:
            self._submit(fn)
        except Exception:  # a full queue: the owner runs `fn`'s work at its next use anyway
            return False
        return True
