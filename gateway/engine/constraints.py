"""Constrained decoding: what a request's output may be, as an llguidance grammar, and the
per-sequence matcher that masks every next token to it.

Why llguidance (measured here with both libraries on the SmolLM2 vocabulary, 49,152 tokens, over
a grammar for one call to any of the 100 merchant tools with schema-valid arguments): compiling
the grammar and building a matcher takes 19 ms with llguidance (it builds its lexer lazily)
against 74-89 ms for xgrammar's compile, and a mask costs both ~0.05-0.1 ms per token (p95
0.1 ms / 0.1-0.2 ms): under 1% of a decode step's ~50 ms on the default model. llguidance also
reads Lark with `%json` schemas inline, so a family's call syntax and every tool's JSON schema are
one grammar, and its lazy lexemes express `tool_choice: "auto"` (free text until the call's
opening, then only a listed tool with valid arguments) without a second pass.

The grammars themselves (Lark text: what is constrained, how schemas are tightened) are built in
grammar_text.py; this module compiles them (`Grammars`, cached per tenant) and matches a
sequence's tokens against one (`Constraint`).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

GRAMMAR_CACHE_BYTES = 256 * 1024**2  # compiled grammars kept, estimated (a group's tool grammar serves every request)
# A compiled grammar's memory, estimated from its Lark text: measured with llguidance 1.9 on the
# SmolLM2 vocabulary (RSS grown over 5-20 distinct grammars kept), 2-37 bytes per character of
# text, by shape: ~2-6 for long descriptions, enums and anyOf lists, ~37 for objects with thousands
# of properties (nested or not); 40 covers them all. Plus a fixed part for the smallest.
GRAMMAR_BYTES_PER_CHAR = 40
GRAMMAR_BASE_BYTES = 64 * 1024


class GrammarError(ValueError):
    """A schema or tool list the grammar engine cannot compile; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class ConstraintViolation(RuntimeError):
    """The matcher refused a token it had allowed (a bug, never the model's fault)."""


class GrammarLimit(ConstraintViolation):
    """The grammar ran past one of llguidance's limits while generating (an object with thousands
    of optional properties grows a parser row by four items each): the schema's fault, so a 400
    naming `param`, not a server error. Found only by following the output, so it can come after
    the response has started."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# llguidance's resource limits. Its default row of 2,000 Earley items holds ~500 optional
# properties of one object; OpenAI's structured outputs take objects of up to 5,000. Measured on
# the SmolLM2 vocabulary on the 2-vCPU machine, a mask of a 2,000-property object costs 18 ms
# (p50) and of 5,000 properties 84 ms, more than a decode step, and the engine thread computes
# every row's mask: 10,000 items (2,500 properties) serves the schemas seen in real tool catalogs
# with room to spare and bounds what one request's mask can cost the batch.
MAX_ITEMS_IN_ROW = 10_000
_LIMIT_ERROR = re.compile(r"items; max is|too many items|fuel|too many states|too big \(limit", re.IGNORECASE)


# ---- matching ----------------------------------------------------------------------------------


class Grammars:
    """Compiles grammars for one tokenizer and keeps the compiled ones (bounded by their estimated
    bytes, `grammar_bytes`): a tool group's grammar is built once and copied for each request that
    uses it. Kept per namespace (the request's tenant): a tenant only ever reuses a grammar it
    compiled itself, so how long its request takes never tells it what another sent. Past the
    bound, the namespace keeping the most bytes gives up its least recently used grammar, so a
    tenant that sends many schemas evicts its own, not another tenant's few."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int],
                 max_bytes: int = GRAMMAR_CACHE_BYTES) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_ids)
        self.max_bytes = max_bytes
        self._compiled: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()  # (namespace, grammar)
        self.num_bytes = 0  # the kept grammars' estimated bytes
        self._namespace_bytes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._closers: tuple[torch.Tensor, ...] | None = None
        self.compiles = 0

    def cached(self, namespace: str = "") -> list[str]:
        """The grammars `namespace` has compiled and that are still kept, oldest first."""
        with self._lock:
            return [grammar for ns, grammar in self._compiled if ns == namespace]

    def _lltokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                           eos_token=self._eos or None)
        return self._tokenizer

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
        return self._tokenizer is not None and self._closers is not None

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

    def _compile(self, grammar: str, param: str, tokenizer: Any) -> Any:
        import llguidance

        try:
            compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
            limits = llguidance.LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW)
            matcher = llguidance.LLMatcher(tokenizer, compiled, limits=limits)
        except Exception as exc:  # the library's own errors carry the reason
            raise GrammarError(f"the schema cannot be used for constrained decoding: {exc}", param) from None
        if matcher.is_error():
            raise GrammarError(f"the schema cannot be used for constrained decoding: {_first_line(matcher)}",
                               param)
        return matcher


def grammar_bytes(grammar: str) -> int:
    """A compiled grammar's estimated memory (see GRAMMAR_BYTES_PER_CHAR), its text included."""
    return GRAMMAR_BASE_BYTES + GRAMMAR_BYTES_PER_CHAR * len(grammar)


_LISTING = re.compile(r"\s*\d+ \| ")  # "   2 | answer: %json {...}": llguidance quoting the grammar


def _first_line(matcher: Any) -> str:
    """llguidance's error on one line: a regex error spans several ("regex parse error:", the
    pattern, a caret line, "error: unclosed group"), and its first alone named neither."""
    error = str(matcher.get_error() or "").strip()
    if not error:
        return "unknown error"
    lines = []
    for line in error.splitlines():
        if _LISTING.match(line):  # then the grammar, line by line: toolkv's text, not the client's
            break
        if line.strip() and set(line.strip()) != {"^"}:
            lines.append(line.strip())
    text = " ".join(lines) or error.splitlines()[0]
    return text if len(text) <= 400 else text[:400] + "..."


@dataclass(slots=True)
class Constraint:
    """One sequence's grammar state: the mask of its next token (`prepare`, on the CPU, while the
    device runs the step; applied on the device by sampling.device_picks as this packed bitmask),
    the tokens it forces next (`forced`), and following the tokens the sequence takes (`accept`).

    Closing: from its `closing_from`-th generated token on (the last `constrained_reserve_tokens`
    before `max_tokens`, at most a quarter of them), it keeps only the allowed tokens that end
    something, when there are any (`Grammars.closers`: the output, a string, a container, a
    value); the model still ranks them. A call or answer the model would have run past `max_tokens` (the default model
    repeats itself inside strings) ends valid instead of being cut off; when the reserve is not
    enough, it is cut as OpenAI cuts it (finish `length`).

    Forced tokens: where the grammar allows one continuation only (a call's opening, a tool name
    once its prefix is unique, a required key), llguidance's fast-forward tokens spell it in the
    tokenizer's canonical tokens. They are the sequence's next tokens whatever the logits say: the
    engine feeds them as one chunk (core.py); token by token (`queue`), each one's mask is that
    token alone, so both ways write the same tokens."""

    matcher: Any
    vocab_size: int
    param: str = "tools"  # the request field whose schema this grammar is: named when one runs past a limit
    closing_from: int | None = None
    closers: tuple[torch.Tensor, ...] = ()
    generated: int = 0
    bitmask: torch.Tensor | None = None  # the next token's mask (int32 words, bit j of word w: token 32w + j)
    queue: list[int] = field(default_factory=list)  # forced tokens to take one at a time, in order
    _words: torch.Tensor | None = None
    _ready: bool = False  # the bitmask is the grammar's for the next token (prepare ran since the last token)

    def consume(self, tokens: list[int]) -> None:
        self._ready = False
        if not self.matcher.consume_tokens(tokens) or self.matcher.is_error():
            raise self._violation("the grammar refused the forced tokens")

    def prepare(self) -> None:
        """Compute which tokens the grammar allows next (the CPU's part of masking) into `bitmask`.
        The engine calls it after launching a step's forward, so on a GPU it runs while the device
        computes the logits."""
        if self._ready:
            return
        if self.queue:
            self.bitmask = only(self.queue[0], self.vocab_size)
            self._ready = True
            return
        import llguidance.torch as llt  # lazy: llguidance's torch helpers load with the first grammar

        if self._words is None:
            self._words = llt.allocate_token_bitmask(1, self.vocab_size)
        llt.fill_next_token_bitmask(self.matcher, self._words, 0)
        if self.matcher.is_error():
            raise self._violation("the grammar could not compute the next token's mask")
        words = self._words[0].clone()  # a mask staged for the device stays as it was
        if self.closing_from is not None and self.generated >= self.closing_from:
            words = self._closing(words)
        self.bitmask = words
        self._ready = True

    def allowed(self) -> torch.Tensor:
        """The next token's allowed set, a bool mask over the vocabulary (computed if need be)."""
        self.prepare()
        assert self.bitmask is not None
        return unpack(self.bitmask, self.vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` ([vocab]) with every token the grammar does not allow next at -inf (a copy)."""
        return logits.float().masked_fill(~self.allowed(), float("-inf"))

    def _closing(self, words: torch.Tensor) -> torch.Tensor:
        allowed = unpack(words, self.vocab_size)
        for tier in self.closers:
            pick = allowed & tier
            if bool(pick.any()):
                return pack(pick)
        return words

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (none when it allows a choice, or only the end)."""
        if self.queue:
            return []
        return [int(t) for t in self.matcher.compute_ff_tokens()]

    def accept(self, token: int) -> None:
        self._ready = False
        self.generated += 1
        if self.queue:
            expected = self.queue.pop(0)
            if token != expected:
                raise ConstraintViolation(f"the grammar forced token {expected}, not {token}")
        if not self.matcher.consume_token(token):
            raise self._violation(f"the grammar refused token {token}")

    def _violation(self, what: str) -> ConstraintViolation:
        """The matcher's error: a GrammarLimit when it ran past a limit, else a ConstraintViolation."""
        reason = _first_line(self.matcher)
        if _LIMIT_ERROR.search(reason):
            return GrammarLimit(f"the '{self.param}' schema is too large for constrained decoding: {reason}",
                                self.param)
        return ConstraintViolation(f"{what}: {reason}")

    @property
    def finished(self) -> bool:
        """Nothing but the end of the output is allowed any more."""
        return bool(self.matcher.is_stopped())


_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A packed bitmask (int32 words) as a bool mask over `vocab_size` tokens."""
    return ((words.unsqueeze(-1) >> _SHIFTS) & 1).bool().reshape(-1)[:vocab_size]


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """A bool mask over the vocabulary as int32 words (bit j of word w: token 32w + j)."""
    bits = torch.nn.functional.pad(allowed.long(), (0, -allowed.shape[0] % 32)).reshape(-1, 32)
    words = (bits << _SHIFTS.long()).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def only(token: int, vocab_size: int) -> torch.Tensor:
    """The bitmask that allows `token` alone."""
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    allowed[token] = True
    return pack(allowed)
