"""The Responses API's memory: per tenant, the last `max_per_tenant` responses (least recently used
first out), each with the response object as it was returned and its input as listed items (what
`GET /v1/responses/{id}` and `.../input_items` read back), and its `Turn` of the conversation (the
chat messages it added, its input then its output, linked to the turn it continued) for
`previous_response_id`.

A turn keeps its parent turn alive, so a conversation stays whole after older responses leave the
index (their bodies go; the messages stay). Instructions are not stored: OpenAI does not carry
them over either.

Bytes are counted as what is really kept: a tenant is charged for each indexed response's own
body and input items, and once for every turn still alive, whether an indexed response or a
child's link keeps it so (turns are shared, reference-counted: a parent that 60 continuations pin
is charged once, and it stays charged after its own response leaves the index). So a tenant's
byte budget bounds its memory however its conversations branch: evicting the least recently used
responses frees their turns as no other kept response needs them. A response whose own bytes and
whole chain of turns exceed the budget is never kept (the route refuses such a continuation up
front, `fits`). All tenants together are bounded too (`max_bytes`): past it, the tenant holding
the most bytes loses its least recently used response, so one tenant cannot evict another that
stays within its fair share."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class Turn:
    response_id: str
    messages: tuple[dict[str, Any], ...]  # chat messages: this response's input, then its output
    parent: Turn | None = None
    size: int = field(init=False, compare=False, repr=False)  # its messages, as serialized JSON
    chain_bytes: int = field(init=False, compare=False, repr=False)  # its size and every ancestor's

    def __post_init__(self) -> None:
        size = len(orjson.dumps(self.messages))
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "chain_bytes", size + (self.parent.chain_bytes if self.parent else 0))

    def conversation(self) -> list[dict[str, Any]]:
        """Every message of the conversation up to and including this turn, oldest first."""
        chain: list[Turn] = []
        node: Turn | None = self
        while node is not None:
            chain.append(node)
            node = node.parent
        return [message for turn in reversed(chain) for message in turn.messages]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    turn: Turn
    body: dict[str, Any] = field(default_factory=dict)  # the response object, as it was returned
    input_items: tuple[dict[str, Any], ...] = ()  # its `input` as items with ids, in order

    @property
    def response_id(self) -> str:
        return self.turn.response_id


@dataclass(slots=True)
class _Shelf:
    """One tenant's responses, and what they keep alive."""

    index: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)  # LRU first
    own: dict[str, int] = field(default_factory=dict)  # each indexed response's body + input items
    turns: dict[int, tuple[Turn, int]] = field(default_factory=dict)  # live turns by id(): (turn, references)
    bytes: int = 0  # own bytes of the indexed responses + sizes of the live turns


class ResponseStore:
    """Thread-safe: prepare threads look responses up, the event loop adds and deletes them."""

    def __init__(self, max_per_tenant: int, max_bytes_per_tenant: int | None = None,
                 max_bytes: int | None = None) -> None:
        self.max_per_tenant = max_per_tenant
        self.max_bytes_per_tenant = max_bytes_per_tenant  # None: bounded by count alone
        self.max_bytes = max_bytes  # all tenants together; None: no bound beyond the tenants' own
        self._shelves: dict[str, _Shelf] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        """What every tenant's kept responses and live turns weigh, as serialized JSON."""
        return self._bytes

    def tenant_bytes(self, tenant: str) -> int:
        with self._lock:
            shelf = self._shelves.get(tenant)
            return shelf.bytes if shelf is not None else 0

    @property
    def budget(self) -> int | None:
        """The most one response and its chain may weigh to be kept."""
        bounds = [b for b in (self.max_bytes_per_tenant, self.max_bytes) if b is not None]
        return min(bounds) if bounds else None

    @property
    def keeps_nothing(self) -> bool:
        return self.max_per_tenant == 0 or self.budget == 0

    def fits(self, parent: Turn | None, added: int) -> bool:
        """Whether a response continuing `parent` and adding `added` bytes is within the budget."""
        budget = self.budget
        return budget is None or added + (parent.chain_bytes if parent is not None else 0) <= budget

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """`tenant`'s response `response_id` (now the most recently used), or None."""
        with self._lock:
            shelf = self._shelves.get(tenant)
            stored = shelf.index.get(response_id) if shelf is not None else None
            if shelf is not None and stored is not None:
                shelf.index.move_to_end(response_id)
            return stored

    def put(self, tenant: str, stored: StoredResponse) -> bool:
        """Keep `stored` for `tenant`, dropping least recently used responses past the bounds;
        False (nothing kept, nothing evicted) when it and its chain alone exceed the budget."""
        if self.max_per_tenant == 0:
            return False
        own = len(orjson.dumps(stored.body)) + len(orjson.dumps(stored.input_items))
        budget = self.budget
        if budget is not None and own + stored.turn.chain_bytes > budget:
            return False  # kept nowhere, as with `store: false`
        with self._lock:
            shelf = self._shelves.setdefault(tenant, _Shelf())
            if stored.response_id in shelf.index:  # the same id again: the new one replaces it
                self._drop(tenant, shelf, stored.response_id)
                shelf = self._shelves.setdefault(tenant, _Shelf())
            shelf.index[stored.response_id] = stored
            shelf.own[stored.response_id] = own
            self._charge(shelf, own)
            self._acquire(shelf, stored.turn)
            while len(shelf.index) > self.max_per_tenant or (
                    self.max_bytes_per_tenant is not None and shelf.bytes > self.max_bytes_per_tenant):
                self._drop(tenant, shelf, next(iter(shelf.index)))
            while self.max_bytes is not None and self._bytes > self.max_bytes:
                self._drop_from_largest(stored.response_id)
            return True

    def delete(self, tenant: str, response_id: str) -> bool:
        """Forget `tenant`'s response `response_id`; False when there was none. Responses that
        continued it keep their conversation (their turns hold its messages)."""
        with self._lock:
            shelf = self._shelves.get(tenant)
            if shelf is None or response_id not in shelf.index:
                return False
            self._drop(tenant, shelf, response_id)
            return True

    def __len__(self) -> int:
        with self._lock:
            return sum(len(shelf.index) for shelf in self._shelves.values())

    # ---- accounting (under the lock) -----------------------------------------------------------

    def _charge(self, shelf: _Shelf, delta: int) -> None:
        shelf.bytes += delta
        self._bytes += delta

    def _acquire(self, shelf: _Shelf, turn: Turn | None) -> None:
        """One more reference to `turn`: a turn that was not alive becomes so, with its parent."""
        while turn is not None:
            live = shelf.turns.get(id(turn))
            if live is not None:
                shelf.turns[id(turn)] = (turn, live[1] + 1)
                return
            shelf.turns[id(turn)] = (turn, 1)
            self._charge(shelf, turn.size)
            turn = turn.parent

    def _release(self, shelf: _Shelf, turn: Turn | None) -> None:
        """One reference fewer to `turn`: a turn nothing references any more frees its bytes and
        its reference to its parent."""
        while turn is not None:
            _, refs = shelf.turns[id(turn)]
            if refs > 1:
                shelf.turns[id(turn)] = (turn, refs - 1)
                return
            del shelf.turns[id(turn)]
            self._charge(shelf, -turn.size)
            turn = turn.parent

    def _drop(self, tenant: str, shelf: _Shelf, response_id: str) -> None:
        stored = shelf.index.pop(response_id)
        self._charge(shelf, -shelf.own.pop(response_id))
        self._release(shelf, stored.turn)
        if not shelf.index:
            assert not shelf.turns and shelf.bytes == 0, "a tenant without responses keeps nothing alive"
            del self._shelves[tenant]

    def _drop_from_largest(self, keep: str) -> None:
        """Evict the least recently used response of the tenant holding the most bytes (never
        `keep`, the response just added: it fits the budget alone)."""
        _, tenant = max((shelf.bytes, tenant) for tenant, shelf in self._shelves.items()
                        if next(iter(shelf.index)) != keep)  # `keep` is its tenant's newest
        shelf = self._shelves[tenant]
        self._drop(tenant, shelf, next(iter(shelf.index)))


def stored_bytes(stored: StoredResponse) -> int:
    """What a stored response weighs alone, as serialized JSON (its body, its input items, its turn)."""
    return sum(len(orjson.dumps(part)) for part in (stored.body, stored.input_items, stored.turn.messages))
