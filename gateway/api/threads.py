"""Anthropic's message threads (`thread` on `POST /v1/messages`, beta
`message-threads-2026-08-12`): the conversation the server holds between turns, so a client (the
SDKs' tool runners, by default) sends only each turn's new messages.

`{"type": "create"}` answers the request as it is and keeps its `system`, `tools` and messages,
then the reply, under the reply's id. `{"type": "continue", "previous_message_id": id}` takes
`system` and `tools` from that thread (a request that repeats them is refused, as Anthropic's
API refuses it), puts the stored messages before the request's and answers the whole
conversation, rendered as the client would have sent it: its KV is reused as any conversation's
is. Once the continuation's reply is kept, the thread lives under the new id only: each reply is
continued once, as Anthropic's are. An id this key never kept (or one expired, evicted or
already continued) is Anthropic's 404 `not_found_error` with `details.error_code:
"thread_not_found"`, on which both SDKs replay the whole conversation under a new thread.

`ThreadStore` keeps, per tenant, each thread as serialized JSON (its bytes are what it holds:
nothing parsed is kept between turns), least recently used first out past a count and a byte
budget per tenant, all tenants together bounded as well (past it the tenant holding the most
loses its least recently used thread), and each thread forgotten `ttl_s` after its last use.
Breakpoints (`cache_control`) are not kept: Anthropic's threads take none, and toolkv's caching
needs none."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import TypeAdapter, ValidationError

from gateway.errors import BadRequest, NotFound
from gateway.protocol.messages import (
    THREAD_NOT_FOUND,
    MessageIn,
    MessagesRequest,
    TextBlock,
    ThreadContinue,
    ToolIn,
)

THREADS_BETA = "message-threads-2026-08-12"
THREAD_TTL_S = 3600.0  # after its last use; an expired thread costs the client one replay
BLOCK_KEYS = ("content",)  # where blocks nest: a tool's `input` is the client's data, kept as it is

_history = TypeAdapter(list[MessageIn])
_system: TypeAdapter[list[TextBlock] | str | None] = TypeAdapter(list[TextBlock] | str | None)
_tools: TypeAdapter[list[ToolIn] | None] = TypeAdapter(list[ToolIn] | None)


def thread_not_found(message_id: str) -> NotFound:
    """Anthropic's error for it; its code is the envelope's `details.error_code`."""
    return NotFound(f"no thread continues from message '{message_id[:80]}' for this key (it was never kept, or it "
                    "expired, was evicted or was already continued): replay the whole conversation with thread "
                    "{\"type\": \"create\"}", param="thread.previous_message_id", code=THREAD_NOT_FOUND)


@dataclass(slots=True)
class _Shelf:
    """One tenant's threads: serialized records and when each expires, least recently used first."""

    records: OrderedDict[str, tuple[bytes, float]] = field(default_factory=OrderedDict)
    bytes: int = 0


class ThreadStore:
    """Thread-safe: prepare threads read threads, the event loop keeps and drops them."""

    def __init__(self, max_per_tenant: int, max_bytes_per_tenant: int, max_bytes: int,
                 ttl_s: float = THREAD_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_per_tenant = max_per_tenant
        self.max_bytes_per_tenant = max_bytes_per_tenant
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._shelves: dict[str, _Shelf] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def get(self, tenant: str, message_id: str) -> bytes | None:
        """The thread `tenant` kept under `message_id` (now its most recently used), or None."""
        with self._lock:
            shelf = self._expire(tenant)
            kept = shelf.records.get(message_id) if shelf is not None else None
            if shelf is None or kept is None:
                return None
            shelf.records[message_id] = (kept[0], self.clock() + self.ttl_s)
            shelf.records.move_to_end(message_id)
            return kept[0]

    def put(self, tenant: str, message_id: str, record: bytes, replaces: str | None = None) -> bool:
        """Keep `record` under `message_id`, instead of the thread `replaces` (the one it continued);
        False (nothing kept) when it alone exceeds a budget."""
        if self.max_per_tenant == 0 or len(record) > min(self.max_bytes_per_tenant, self.max_bytes):
            return False
        with self._lock:
            shelf = self._expire(tenant) or self._shelves.setdefault(tenant, _Shelf())
            for old in {replaces, message_id} - {None}:
                self._drop(shelf, str(old))
            shelf.records[message_id] = (record, self.clock() + self.ttl_s)
            self._charge(shelf, len(record))
            while len(shelf.records) > self.max_per_tenant or shelf.bytes > self.max_bytes_per_tenant:
                self._drop(shelf, next(iter(shelf.records)))
            while self._bytes > self.max_bytes:
                self._drop_from_largest(message_id)
            return True

    def __len__(self) -> int:
        with self._lock:
            return sum(len(shelf.records) for shelf in self._shelves.values())

    # ---- under the lock --------------------------------------------------------------------------

    def _expire(self, tenant: str) -> _Shelf | None:
        """`tenant`'s shelf without its expired threads (each use renews a thread's time, so the
        least recently used are the first to expire)."""
        shelf = self._shelves.get(tenant)
        now = self.clock()
        while shelf is not None and shelf.records and next(iter(shelf.records.values()))[1] <= now:
            self._drop(shelf, next(iter(shelf.records)))
        return shelf

    def _charge(self, shelf: _Shelf, delta: int) -> None:
        shelf.bytes += delta
        self._bytes += delta

    def _drop(self, shelf: _Shelf, message_id: str) -> None:
        kept = shelf.records.pop(message_id, None)
        if kept is not None:
            self._charge(shelf, -len(kept[0]))

    def _drop_from_largest(self, keep: str) -> None:
        """The least recently used thread of the tenant holding the most bytes (never `keep`)."""
        _, tenant = max((shelf.bytes, tenant) for tenant, shelf in self._shelves.items()
                        if shelf.records and next(iter(shelf.records)) != keep)
        shelf = self._shelves[tenant]
        self._drop(shelf, next(iter(shelf.records)))
        if not shelf.records:
            del self._shelves[tenant]


# ---- a request's thread ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ThreadTurn:
    """What keeping a threaded request's reply needs: the conversation so far, as JSON."""

    tenant: str
    continues: str | None  # the id it continued; None for a `create`
    system: Any
    tools: Any
    messages: list[Any]

    def record(self, reply: list[dict[str, Any]]) -> bytes:
        """The thread with `reply` (the message's content blocks) as its last turn."""
        answer = {"role": "assistant", "content": reply or ""}
        return orjson.dumps({"system": self.system, "tools": self.tools, "messages": [*self.messages, answer]})


def threaded(req: MessagesRequest, store: ThreadStore, tenant: str) -> tuple[MessagesRequest, ThreadTurn | None]:
    """`req` as the whole conversation it continues (unchanged without a `continue`), and what
    keeping its reply needs (None without a `thread`)."""
    if req.thread is None:
        return req, None
    if isinstance(req.thread, ThreadContinue):
        req = _continued(req, req.thread.previous_message_id, store, tenant)
    continues = req.thread.previous_message_id if isinstance(req.thread, ThreadContinue) else None
    return req, ThreadTurn(tenant, continues, _dumped(req.system), _dumped(req.tools), _dumped(req.messages))


def _continued(req: MessagesRequest, previous: str, store: ThreadStore, tenant: str) -> MessagesRequest:
    for name in ("system", "tools"):
        if getattr(req, name) is not None:
            raise BadRequest(f"'{name}' is taken from the thread on a continue: leave it out, or replay the whole "
                             "conversation with thread {\"type\": \"create\"} to change it", param=name)
    kept = store.get(tenant, previous)
    if kept is None:
        raise thread_not_found(previous)
    record = orjson.loads(kept)
    try:
        history = _history.validate_python(record["messages"])
        system, tools = _system.validate_python(record["system"]), _tools.validate_python(record["tools"])
    except ValidationError:  # kept from a request this server validated: not expected
        raise thread_not_found(previous) from None
    return req.model_copy(update={"messages": [*history, *req.messages], "system": system, "tools": tools})


def _dumped(value: Any) -> Any:
    """Request parts as JSON, without their breakpoints."""
    if isinstance(value, list):
        return [_dumped(item) for item in value]
    if hasattr(value, "model_dump"):
        return _without_cache_control(value.model_dump(mode="json", by_alias=True, exclude_none=True))
    return value


def _without_cache_control(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_cache_control(item) if key in BLOCK_KEYS else item
                for key, item in value.items() if key != "cache_control"}
    if isinstance(value, list):
        return [_without_cache_control(item) for item in value]
    return value
