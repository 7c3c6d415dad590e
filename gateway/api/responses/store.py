"""The Responses API's memory: per tenant, the last `max_per_tenant` responses (least recently used
first out), each with the response object as it was returned and its input as listed items (what
`GET /v1/responses/{id}` and `.../input_items` read back), and its `Turn` of the conversation (the
chat messages it added, its input then its output, linked to the turn it continued) for
`previous_response_id`.

A turn keeps its parent turn alive, so a conversation stays whole after older responses leave the
index (their bodies go; the messages stay). Instructions are not stored: OpenAI does not carry
them over either.

What is kept is serialized JSON (orjson bytes), parsed again on each read: the count is what is
held. Parsed objects took about 20 times the bytes of their JSON (a body of many `[]`: 17 MB
counted, 330 MB resident), so a budget of parsed objects bounded nothing. Each response and each
turn is charged its JSON's bytes plus a fixed allowance for the objects holding them
(`RESPONSE_OVERHEAD_BYTES`, `TURN_OVERHEAD_BYTES`, measured with tracemalloc:
tests/security/test_bounded_memory.py).

Bytes are counted as what is really kept: a tenant is charged for each indexed response's own
body and input items, and once for every turn still alive, whether an indexed response or a
child's link keeps it so (turns are shared, reference-counted: a parent that 60 continuations pin
is charged once, and it stays charged after its own response leaves the index). So a tenant's
byte budget bounds its memory however its conversations branch: evicting the least recently used
responses frees their turns as no other kept response needs them. A response whose own bytes and
whole chain of turns exceed the budget is never kept (the route refuses such a continuation up
front, `fits`). All tenants together are bounded too (`max_bytes`): past it, the tenant holding
the most bytes loses its least recently used response, so one tenant cannot evict another that
stays within its fair share.

A response exists from its first event: `begin` makes it readable (status `in_progress`) and
deletable while it is generated; a delete then sticks: `put` keeps nothing for it when it ends.
In-progress responses are not charged: there is one per request running, which admission bounds."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

RESPONSE_OVERHEAD_BYTES = 640  # its record, two bytes objects, its id and its places in the shelf's maps
TURN_OVERHEAD_BYTES = 320  # the turn object, its bytes object and its place among the live turns


def _exact(data: bytes) -> bytes:
    """`data` in a bytes object of its own size: orjson's output keeps its write buffer (4 KiB at
    least), which a store of small responses would hold many times over."""
    return memoryview(data).tobytes()


class Turn:
    """One response's messages (serialized), linked to the turn it continued."""

    __slots__ = ("chain_bytes", "messages_json", "parent", "response_id", "size")
    response_id: str
    messages_json: bytes
    parent: Turn | None
    size: int
    chain_bytes: int

    def __init__(self, response_id: str, messages: tuple[dict[str, Any], ...] | list[dict[str, Any]],
                 parent: Turn | None = None) -> None:
        self.response_id = response_id
        self.messages_json = _exact(orjson.dumps(messages))
        self.parent = parent
        self.size = len(self.messages_json) + TURN_OVERHEAD_BYTES  # what it holds
        self.chain_bytes = self.size + (parent.chain_bytes if parent else 0)  # its size and every ancestor's

    @property
    def messages(self) -> tuple[dict[str, Any], ...]:
        """Its chat messages (this response's input, then its output), parsed anew."""
        return tuple(orjson.loads(self.messages_json))

    def conversation(self) -> list[dict[str, Any]]:
        """Every message of the conversation up to and including this turn, oldest first."""
        chain: list[Turn] = []
        node: Turn | None = self
        while node is not None:
            chain.append(node)
            node = node.parent
        return [message for turn in reversed(chain) for message in turn.messages]


class StoredResponse:
    """A kept response: its turn, the response object as it was returned and its input as listed
    items, both serialized."""

    __slots__ = ("body_json", "items_json", "turn")
    turn: Turn
    body_json: bytes
    items_json: bytes

    def __init__(self, turn: Turn, body: dict[str, Any] | None = None,
                 input_items: tuple[dict[str, Any], ...] = ()) -> None:
        self.turn = turn
        self.body_json = _exact(orjson.dumps(body if body is not None else {}))
        self.items_json = _exact(orjson.dumps(input_items))

    @property
    def response_id(self) -> str:
        return self.turn.response_id

    @property
    def body(self) -> dict[str, Any]:
        parsed: dict[str, Any] = orjson.loads(self.body_json)
        return parsed

    @property
    def input_items(self) -> tuple[dict[str, Any], ...]:
        return tuple(orjson.loads(self.items_json))

    @property
    def own_bytes(self) -> int:
        """Its body and input items, as held (its turn is charged apart: turns are shared)."""
        return len(self.body_json) + len(self.items_json) + RESPONSE_OVERHEAD_BYTES


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
        self._running: dict[tuple[str, str], StoredResponse] = {}  # begun, not yet ended
        self._deleted: set[tuple[str, str]] = set()  # deleted while running: never kept
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        """What every tenant's kept responses and live turns hold (their JSON and objects)."""
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

    # ---- responses being generated -----------------------------------------------------------

    def begin(self, tenant: str, response_id: str, body: dict[str, Any],
              input_items: tuple[dict[str, Any], ...]) -> None:
        """The response exists from now on (its `in_progress` body): readable and deletable."""
        with self._lock:
            self._running[(tenant, response_id)] = StoredResponse(Turn(response_id, ()), body, input_items)

    def end(self, tenant: str, response_id: str) -> None:
        """The response's generation is over, kept (`put`) or not (a failure, a hang-up)."""
        with self._lock:
            self._running.pop((tenant, response_id), None)
            self._deleted.discard((tenant, response_id))

    def find(self, tenant: str, response_id: str) -> StoredResponse | None:
        """What GET reads: the kept response, or the one still running (its `in_progress` body)."""
        with self._lock:
            running = self._running.get((tenant, response_id))
        return running if running is not None else self.get(tenant, response_id)

    # ---- kept responses ------------------------------------------------------------------------

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
        with self._lock:
            key = (tenant, stored.response_id)
            self._running.pop(key, None)
            if key in self._deleted:  # deleted while it ran: the client's delete sticks
                self._deleted.discard(key)
                return False
        if self.max_per_tenant == 0:
            return False
        own = stored.own_bytes
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
        continued it keep their conversation (their turns hold its messages). One still running
        is forgotten now and never kept."""
        with self._lock:
            if self._running.pop((tenant, response_id), None) is not None:
                self._deleted.add((tenant, response_id))  # still running: never kept when it ends
                return True
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
    """What a stored response is charged alone: its body, its input items and its turn, as held."""
    return stored.own_bytes + stored.turn.size
