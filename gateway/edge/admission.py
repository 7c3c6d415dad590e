"""What a chat request passes before it reaches the engine, and what it holds while it runs.

- `Preparer`: parsing, validating, rendering and tokenizing run on a small pool of worker
  threads, never on the event loop (a 4 MB prompt takes the loop's time from `/health` and from
  every other stream otherwise). The pool is bounded: past `max_pending` requests waiting for it,
  a request gets 429.
- `TenantQuota`: each API key may have at most `limit` chat requests queued or running, so one
  key cannot fill the engine's queue and starve the others (429 + `Retry-After`). The open
  gateway (no keys) has one tenant and only the engine's global queue bound.
- `disconnected`: resolves when the client hangs up, so a non-streaming request can be cancelled
  like a stream.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from starlette.requests import Request

from gateway.errors import Overloaded

T = TypeVar("T")

PREPARE_WORKERS = 2
RETRY_AFTER = {"Retry-After": "1"}


class Preparer:
    def __init__(self, max_pending: int, workers: int = PREPARE_WORKERS) -> None:
        self.max_pending = max_pending
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="toolkv-prepare")
        self._pending = 0  # only touched on the event loop

    async def run(self, fn: Callable[[], T]) -> T:
        if self._pending >= self.max_pending:
            raise Overloaded("the server is busy: too many requests are being prepared; retry shortly",
                             headers=RETRY_AFTER)
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        finally:
            self._pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class TenantQuota:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def acquire(self, tenant: str) -> Callable[[], None]:
        """Take one of `tenant`'s slots; the returned callable gives it back (once)."""
        with self._lock:
            if self._held[tenant] >= self.limit:
                raise Overloaded(f"this API key already has {self.limit} requests queued or running; "
                                 "retry when one finishes", code="too_many_requests_for_key",
                                 headers=RETRY_AFTER)
            self._held[tenant] += 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self._held[tenant] -= 1
                    if self._held[tenant] <= 0:
                        del self._held[tenant]

        return release

    def held(self, tenant: str) -> int:
        with self._lock:
            return self._held[tenant]


async def disconnected(request: Request) -> None:
    """Returns when the client has gone away (after the body was read, the server's next message
    is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
