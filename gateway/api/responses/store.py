"""The Responses API's memory: per tenant, the last `max_per_tenant` responses (least recently used
first out), each with the response object as it was returned and its input as listed items (what
`GET /v1/responses/{id}` and `.../input_items` read back), and its `Turn` of the conversation (the
chat messages it added, its input then its output, linked to the turn it continued) for
`previous_response_id`.

A turn keeps its parent turn alive, so a conversation stays whole after older responses leave the
index (their bodies go; the messages stay); a conversation is bounded by the model's context (a
longer one could not be answered, so it is never stored). Instructions are not stored: OpenAI does
not carry them over either."""

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


class ResponseStore:
    """Thread-safe: prepare threads look responses up, the event loop adds and deletes them."""

    def __init__(self, max_per_tenant: int, max_bytes_per_tenant: int | None = None) -> None:
        self.max_per_tenant = max_per_tenant
        self.max_bytes_per_tenant = max_bytes_per_tenant  # None: bounded by count alone
        self._tenants: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._sizes: dict[str, dict[str, int]] = {}  # per tenant: each response's serialized bytes
        self._lock = threading.Lock()

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """`tenant`'s response `response_id` (now the most recently used), or None."""
        with self._lock:
            responses = self._tenants.get(tenant)
            stored = responses.get(response_id) if responses is not None else None
            if responses is not None and stored is not None:
                responses.move_to_end(response_id)
            return stored

    def put(self, tenant: str, stored: StoredResponse) -> None:
        """Keep `stored` for `tenant`, dropping its least recently used response past the bound."""
        if self.max_per_tenant == 0:
            return
        size = stored_bytes(stored)
        if self.max_bytes_per_tenant is not None and size > self.max_bytes_per_tenant:
            return  # larger than the whole budget: kept nowhere, as with `store: false`
        with self._lock:
            responses = self._tenants.setdefault(tenant, OrderedDict())
            sizes = self._sizes.setdefault(tenant, {})
            responses[stored.response_id] = stored
            responses.move_to_end(stored.response_id)
            sizes[stored.response_id] = size
            while len(responses) > self.max_per_tenant or (
                    self.max_bytes_per_tenant is not None and sum(sizes.values()) > self.max_bytes_per_tenant):
                dropped, _ = responses.popitem(last=False)
                del sizes[dropped]

    def delete(self, tenant: str, response_id: str) -> bool:
        """Forget `tenant`'s response `response_id`; False when there was none. Responses that
        continued it keep their conversation (their turns hold its messages)."""
        with self._lock:
            responses = self._tenants.get(tenant)
            if responses is None or responses.pop(response_id, None) is None:
                return False
            self._sizes[tenant].pop(response_id, None)
            if not responses:
                del self._tenants[tenant], self._sizes[tenant]
            return True

    def __len__(self) -> int:
        with self._lock:
            return sum(len(responses) for responses in self._tenants.values())


def stored_bytes(stored: StoredResponse) -> int:
    """What a stored response weighs, as serialized JSON (its body, its input items, its turn)."""
    return sum(len(orjson.dumps(part)) for part in (stored.body, stored.input_items, stored.turn.messages))
