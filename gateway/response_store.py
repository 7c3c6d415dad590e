"""The Responses API's memory for `previous_response_id`: per tenant, the last `max_per_tenant`
responses (least recently used first out), each holding the chat messages it added to its
conversation (its input, then its output) and a link to the response it continued.

A response keeps its parent alive, so a conversation stays whole after older ids leave the
index; a conversation is bounded by the model's context (a longer one could not be answered, so
it is never stored). Instructions are not stored: OpenAI does not carry them over either."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response_id: str
    messages: tuple[dict[str, Any], ...]  # chat messages: this response's input, then its output
    parent: StoredResponse | None = None

    def conversation(self) -> list[dict[str, Any]]:
        """Every message of the conversation up to and including this response, oldest first."""
        chain: list[StoredResponse] = []
        node: StoredResponse | None = self
        while node is not None:
            chain.append(node)
            node = node.parent
        return [message for stored in reversed(chain) for message in stored.messages]


class ResponseStore:
    """Thread-safe: prepare threads look responses up, the event loop adds them."""

    def __init__(self, max_per_tenant: int) -> None:
        self.max_per_tenant = max_per_tenant
        self._tenants: dict[str, OrderedDict[str, StoredResponse]] = {}
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
        with self._lock:
            responses = self._tenants.setdefault(tenant, OrderedDict())
            responses[stored.response_id] = stored
            responses.move_to_end(stored.response_id)
            while len(responses) > self.max_per_tenant:
                responses.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(responses) for responses in self._tenants.values())
