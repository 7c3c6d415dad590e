"""Whether a JSON schema has a finite instance at all. `{"$ref": "#"}`, or an object that requires a
property of its own type, has none: a grammar for it compiles, and then fails at its first mask or
in the middle of a call (the model can only ever write more). Checked at request time, such a
schema is a 400 naming it instead of a failed generation.

The schema is read as an AND/OR graph (an instance of a schema needs one of every part: its `$ref`,
each `allOf` member, one `anyOf`/`oneOf` member, and one allowed type, where an object needs a value
for every required property and an array one for each of its `minItems` first items) and its
finite nodes are found as a grammar's productive symbols are: from the leaves up, in linear time.
Conservative: whatever it cannot follow (remote refs, `not`, `if`, pattern-matched keys) counts as
finite, so it never refuses a schema with an instance; the grammar engine judges the rest."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

_SCALAR_TYPES = frozenset({"string", "number", "integer", "boolean", "null"})


def has_finite_instance(schema: Any) -> bool:
    """False only when no finite JSON value is valid for `schema` (see the module doc)."""
    graph = _Graph(schema)
    return graph.finite(graph.build())


@dataclass(slots=True)
class _Node:
    any_of: bool  # one child finite suffices (else: all of them are needed)
    children: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)


class _Graph:
    def __init__(self, root: Any) -> None:
        self._root = root
        self._nodes: list[_Node] = []
        self._of_schema: dict[int, int] = {}  # id(schema dict) -> node: `$ref`s share their target's
        self._unread: list[tuple[int, dict[str, Any]]] = []  # nodes whose parts are not linked yet

    def build(self) -> int:
        """The root's node, with every node it reaches (a loop, not recursion: `$ref` chains are
        as long as the schema allows)."""
        start = self.node(self._root)
        while self._unread:
            index, schema = self._unread.pop()
            for part in self._parts(schema):
                self._link(index, part)
        return start

    def finite(self, start: int) -> bool:
        done = [False] * len(self._nodes)
        pending = [0 if n.any_of else len(n.children) for n in self._nodes]
        queue = deque(i for i, n in enumerate(self._nodes) if not n.any_of and not n.children)
        while queue:
            index = queue.popleft()
            if done[index]:
                continue
            done[index] = True
            for parent in self._nodes[index].parents:
                pending[parent] -= 1
                if self._nodes[parent].any_of or pending[parent] <= 0:
                    queue.append(parent)
        return done[start]

    def _new(self, any_of: bool, children: tuple[int, ...] | list[int] = ()) -> int:
        self._nodes.append(_Node(any_of))
        index = len(self._nodes) - 1
        for child in children:
            self._link(index, child)
        return index

    def _link(self, parent: int, child: int) -> None:
        self._nodes[parent].children.append(child)
        self._nodes[child].parents.append(parent)

    def node(self, schema: Any) -> int:
        if not isinstance(schema, dict):  # `false` has no instance; `true` (or anything unreadable) has
            return self._new(any_of=schema is False)
        known = self._of_schema.get(id(schema))
        if known is not None:
            return known
        index = self._of_schema[id(schema)] = self._new(any_of=False)
        self._unread.append((index, schema))
        return index

    def _parts(self, schema: dict[str, Any]) -> list[int]:
        parts = []
        target = self._resolve(schema.get("$ref"))
        if target is not None:
            parts.append(self.node(target))
        parts += [self.node(member) for member in _list(schema.get("allOf"))]
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                parts.append(self._new(True, [self.node(member) for member in schema[key]]))
        if "enum" not in schema and "const" not in schema:  # an enum's values are finite already
            parts.append(self._type_part(schema))
        return parts

    def _type_part(self, schema: dict[str, Any]) -> int:
        kind = schema.get("type")
        kinds = [kind] if isinstance(kind, str) else _list(kind)
        if not kinds or any(k in _SCALAR_TYPES or not isinstance(k, str) for k in kinds):
            return self._new(any_of=False)  # no type given, or a scalar one: a finite value fits
        alternatives = []
        if "object" in kinds:
            alternatives.append(self._new(False, [self.node(s) for s in _required_values(schema)]))
        if "array" in kinds:
            alternatives.append(self._new(False, [self.node(s) for s in _first_items(schema)]))
        return self._new(True, alternatives)

    def _resolve(self, ref: Any) -> Any:
        """The schema a local `$ref` ("#" or "#/json/pointer") names; None for any other."""
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return None
        here: Any = self._root
        for token in ref[2:].split("/") if ref != "#" else ():
            token = unquote(token).replace("~1", "/").replace("~0", "~")
            if isinstance(here, dict) and token in here:
                here = here[token]
            elif isinstance(here, list) and token.isdigit() and int(token) < len(here):
                here = here[int(token)]
            else:
                return None
        return here


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _required_values(schema: dict[str, Any]) -> list[Any]:
    """The schemas an object's required properties must hold (unknown ones count as any value)."""
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    extra = schema.get("additionalProperties", True) if "patternProperties" not in schema else True
    return [properties.get(name, extra) for name in _list(schema.get("required")) if isinstance(name, str)]


def _first_items(schema: dict[str, Any]) -> list[Any]:
    """The schemas an array's first `minItems` items must hold."""
    least = schema.get("minItems")
    if not isinstance(least, int) or isinstance(least, bool) or least < 1:
        return []
    items = schema.get("items", True)
    prefix = schema.get("prefixItems", items if isinstance(items, list) else [])
    rest = items if not isinstance(items, list) else schema.get("additionalItems", True)
    return list(prefix[:least]) + ([rest] if least > len(prefix) else [])
