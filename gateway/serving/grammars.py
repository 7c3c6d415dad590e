"""The grammar compiler and its caches: a request's output grammar compiled by llguidance for the
model's tokenizer, the compiled ones kept per tenant, and a fresh matcher for each request.

Why llguidance (measured here with both libraries on the SmolLM2 vocabulary, 49,152 tokens, over
a grammar for one call to any of the 100 merchant tools with schema-valid arguments): compiling
the grammar and building a matcher takes 19 ms with llguidance (it builds its lexer lazily)
against 74-89 ms for xgrammar's compile, and a mask costs both ~0.05-0.1 ms per token (p95
0.1 ms / 0.1-0.2 ms): under 1% of a decode step's ~50 ms on the default model. llguidance also
reads Lark with `%json` schemas inline, so a family's call syntax and every tool's JSON schema are
one grammar, and its lazy lexemes express `tool_choice: "auto"` (free text until the call's
opening, then only a listed tool with valid arguments) without a second pass.

The grammars' text (Lark: what is constrained, how schemas are tightened) is output_grammar.py's;
this module compiles it (`Grammars`, kept per tenant) into a fresh matcher per request, the
engine's `Constraint` (gateway/engine/constraints.py), which masks and follows one sequence.

`SchemaMemo` remembers, per tenant too, what a request's schemas gave last time: the
finite-instance check and the grammar rule of each tool's `parameters` (and of a
`response_format` schema) are pure functions of the schema, and an agent sends the same tools on
every turn. Walking 20 tool schemas for both took ~0.8 ms of a 1.7 ms `prepare` on the
development CPU, on every hit; a memo hit costs one `orjson.dumps` of each. Keyed by the schema's
exact JSON (key order and number types included: both change the grammar) and a namespace, the
tenant: one tenant's schemas never make another's requests faster, as with compiled grammars and
tokenized heads. Bounded in bytes (keys, values and the entries holding them, as held: a
tracemalloc test holds the memo to its bound); a schema over `max_entry_bytes`, or one orjson
cannot write, is computed each time. An exception (a 400 for the schema) is never remembered.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import orjson
import torch

from gateway.engine import Constraint, Tokenizer, matcher_error

GRAMMAR_CACHE_BYTES = 256 * 1024**2  # compiled grammars kept, estimated (a group's tool grammar serves every request)
# A compiled grammar's memory, estimated from its Lark text: measured with llguidance 1.9 on the
# SmolLM2 vocabulary (RSS grown over 5-20 distinct grammars kept), 2-37 bytes per character of
# text, by shape: ~2-6 for long descriptions, enums and anyOf lists, ~37 for objects with thousands
# of properties (nested or not); 40 covers them all. Plus a fixed part for the smallest.
GRAMMAR_BYTES_PER_CHAR = 40
GRAMMAR_BASE_BYTES = 64 * 1024


# llguidance's resource limits. Its default row of 2,000 Earley items holds ~500 optional
# properties of one object; OpenAI's structured outputs take objects of up to 5,000. Measured on
# the SmolLM2 vocabulary on the 2-vCPU machine, a mask of a 2,000-property object costs 18 ms
# (p50) and of 5,000 properties 84 ms, more than a decode step, and the engine thread computes
# every row's mask: 10,000 items (2,500 properties) serves the schemas seen in real tool catalogs
# with room to spare and bounds what one request's mask can cost the batch.
MAX_ITEMS_IN_ROW = 10_000


class GrammarError(ValueError):
    """A schema or tool list the grammar engine cannot compile; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class Grammars:
    """Compiles grammars for one tokenizer and keeps the compiled ones (bounded by their estimated
    bytes, `grammar_bytes`): a tool group's grammar is built once and copied for each request that
    uses it. Kept per namespace (the request's tenant): a tenant only ever reuses a grammar it
    compiled itself, so how long its request takes never tells it what another sent. Past the
    bound, the namespace keeping the most bytes gives up its least recently used grammar, so a
    tenant that sends many schemas evicts its own, not another tenant's few."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Iterable[int],
                 max_bytes: int = GRAMMAR_CACHE_BYTES) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_ids)
        self.max_bytes = max_bytes
        self._compiled: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()  # (namespace, grammar)
        self.num_bytes = 0  # the kept grammars' estimated bytes
        self._namespace_bytes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._lltokenizer_view: Any = None
        self._closers: tuple[torch.Tensor, ...] | None = None
        self.compiles = 0

    def cached(self, namespace: str = "") -> list[str]:
        """The grammars `namespace` has compiled and that are still kept, oldest first."""
        with self._lock:
            return [grammar for ns, grammar in self._compiled if ns == namespace]

    def _lltokenizer(self) -> Any:
        if self._lltokenizer_view is None:
            import llguidance.hf

            self._lltokenizer_view = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                           eos_token=self._eos or None)
        return self._lltokenizer_view

    def constraint(self, grammar: str, param: str, forced: Sequence[int] = (),
                   closing_from: int | None = None, *, namespace: str = "") -> Constraint:
        """A fresh matcher for `grammar`, having consumed `forced` (text the prompt already ends
        with, as if generated); from its `closing_from`-th token on it steers to the nearest end
        (see `Constraint`). GrammarError (naming `param`) when it does not compile. Only
        `namespace`'s own compiled grammars are reused."""
        key = (namespace, grammar)
        with self._lock:
            kept = self._compiled.get(key)
            if kept is not None:
                self._compiled.move_to_end(key)
                matcher = kept[0].deep_copy()
            else:
                self.compiles += 1
                tokenizer = self._lltokenizer()
        if kept is None:  # compiled outside the lock: one tenant's big grammar never holds up another's
            template = self._compile(grammar, param, tokenizer)
            with self._lock:
                self._keep(key, template)
                matcher = template.deep_copy()
        constraint = Constraint(matcher, self.vocab_size, param=param)
        if closing_from is not None:
            constraint.closing_from, constraint.closers = closing_from, self.closers()
        if forced:
            constraint.consume(list(forced))
        return constraint

    @property
    def warmed(self) -> bool:
        """Whether the one-time work of a first grammar (the vocabulary's view, the closing sets) is done."""
        return self._lltokenizer_view is not None and self._closers is not None

    def warm_up(self, grammar: str) -> None:
        """Build what every first compile and match pays once (the vocabulary's view, the closing
        sets), compile `grammar` and mask once with it; the grammar is not kept."""
        constraint = Constraint(self._compile(grammar, "tools", self._lltokenizer()), self.vocab_size, param="tools")
        constraint.closers = self.closers()
        constraint.mask(torch.zeros(self.vocab_size))

    def closers(self) -> tuple[torch.Tensor, ...]:
        """Token sets a closing output prefers, best first (bool masks over the vocabulary), by the
        first character a token writes: the end of the output; a quote (inside a string the only
        allowed quote is its end; outside, a key or value must start anyway); a closing brace or
        bracket; a comma. A token that merely contains them may be string content."""
        if self._closers is None:
            heads = [(self._hf.decode([i]).lstrip()[:1] if i < len(self._hf) else "") for i in range(self.vocab_size)]
            ends = torch.zeros(self.vocab_size, dtype=torch.bool)
            ends[[i for i in self._eos if i < self.vocab_size]] = True
            starts = [torch.tensor([bool(h) and h in chars for h in heads]) for chars in ('"', "}]", ",")]
            self._closers = (ends, *starts)
        return self._closers

    def _keep(self, key: tuple[str, str], template: Any) -> None:
        """Keep a compiled grammar; past the byte bound, evict the least recently used of the
        namespace keeping the most (one larger than the whole bound is used once, not kept)."""
        size = grammar_bytes(key[1])
        if size > self.max_bytes or key in self._compiled:  # or compiled meanwhile by a twin request
            return
        self._compiled[key] = (template, size)
        self._count(key[0], size)
        while self.num_bytes > self.max_bytes:
            largest = max(self._namespace_bytes, key=self._namespace_bytes.__getitem__)
            oldest = next(k for k in self._compiled if k[0] == largest)
            _, dropped = self._compiled.pop(oldest)
            self._count(largest, -dropped)

    def _count(self, namespace: str, size: int) -> None:
        self.num_bytes += size
        left = self._namespace_bytes.get(namespace, 0) + size
        if left:
            self._namespace_bytes[namespace] = left
        else:
            del self._namespace_bytes[namespace]

    def _compile(self, grammar: str, param: str, lltokenizer: Any) -> Any:
        import llguidance

        try:
            compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
            limits = llguidance.LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW)
            matcher = llguidance.LLMatcher(lltokenizer, compiled, limits=limits)
        except Exception as exc:  # the library's own errors carry the reason
            raise GrammarError(f"the schema cannot be used for constrained decoding: {exc}", param) from None
        if matcher.is_error():
            raise GrammarError(f"the schema cannot be used for constrained decoding: {matcher_error(matcher)}",
                               param)
        return matcher


def grammar_bytes(grammar: str) -> int:
    """A compiled grammar's estimated memory (see GRAMMAR_BYTES_PER_CHAR), its text included."""
    return GRAMMAR_BASE_BYTES + GRAMMAR_BYTES_PER_CHAR * len(grammar)


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
