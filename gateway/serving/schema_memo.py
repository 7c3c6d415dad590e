"""What a request's schemas gave last time: the finite-instance check and the grammar rule of each
tool's `parameters` (and of a `response_format` schema) are pure functions of the schema, and an
agent sends the same tools on every turn. Walking 20 tool schemas for both took ~0.8 ms of a
1.7 ms `prepare` on the development CPU, on every hit; a memo hit costs one `orjson.dumps` of each.

Keyed by the schema's exact JSON (key order and number types included: both change the grammar)
and a namespace, the tenant: one tenant's schemas never make another's requests faster, as with
compiled grammars and tokenized heads. Bounded in bytes (keys, values and the entries holding them,
as held: a tracemalloc test holds the memo to its bound); a schema over
`max_entry_bytes`, or one orjson cannot write, is computed each time. An exception (a 400 for the
schema) is never remembered.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import orjson

T = TypeVar("T")

MAX_BYTES = 32 * 1024**2
MAX_ENTRY_BYTES = 1024**2
_ENTRY_OVERHEAD_BYTES = 320


class SchemaMemo:
    def __init__(self, max_bytes: int = MAX_BYTES, max_entry_bytes: int = MAX_ENTRY_BYTES) -> None:
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_entry_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[tuple[str, str, bytes], tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, kind: str, namespace: str, schema: Any, compute: Callable[[], T]) -> T:
        """`compute()`, or what it gave for this `kind` of result of the same schema in `namespace`."""
        try:
            text = orjson.dumps(schema)
        except (TypeError, orjson.JSONEncodeError):  # integers past 64 bits, say: no key, no memo
            return compute()
        if len(text) > self.max_entry_bytes:
            return compute()
        key = (kind, namespace, text)
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                return found[0]  # type: ignore[no-any-return]
        value = compute()
        # the key keeps a copy of its own size: orjson's output holds its write buffer (4 KiB at least)
        key = (kind, namespace, memoryview(text).tobytes())
        # the entry: its tuples, its size, its place in the map (measured: tests/security/test_bounded_memory.py)
        size = sum(sys.getsizeof(part) for part in (*key, value)) + _ENTRY_OVERHEAD_BYTES
        with self._lock:
            if key in self._entries:  # a twin request computed it meanwhile
                return value
            self._entries[key] = (value, size)
            self.num_bytes += size
            while self.num_bytes > self.max_bytes and self._entries:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.num_bytes -= dropped
        return value

    def __len__(self) -> int:
        return len(self._entries)
