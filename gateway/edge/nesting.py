"""Nesting depth of parsed JSON, walked without recursion.

Python's `json`, jinja's `tojson`, pydantic and orjson all recurse on nested input: a hostile
document a few hundred levels deep exhausts the stack (a `RecursionError`, or a C-level recursion
limit) inside whatever touches it first. Measuring the depth with an explicit stack, and refusing
what is too deep before anything recursive sees it, turns that crash into a plain input error.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any

MAX_DOCUMENT_DEPTH = 64  # a whole JSON document (a request body, a warm file) nests at most this deep


class TooDeep(ValueError):
    """`where` nests deeper than `limit` levels."""

    def __init__(self, where: str, limit: int) -> None:
        super().__init__(f"{where} nests deeper than {limit} levels")
        self.where = where
        self.limit = limit


def nesting_depth(value: Any, limit: int) -> int:
    """How deep dicts and lists nest in `value` (a scalar is 0, `{}` and `[]` are 1), given up as
    soon as it passes `limit` so a huge document costs no more than its first too-deep branch."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > limit:
            break
        stack.extend(zip(children, repeat(depth + 1)))
    return deepest


def check_nesting(value: Any, limit: int, where: str) -> None:
    """Raise `TooDeep` when `value` nests deeper than `limit` levels."""
    if nesting_depth(value, limit) > limit:
        raise TooDeep(where, limit)
