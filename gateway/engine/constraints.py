"""One sequence's grammar state during generation (`Constraint`): the mask of its next token,
computed on the CPU while the device runs the step and applied on the device by
sampling.device_picks, the tokens the grammar forces next, and following the tokens the sequence
takes. The grammars themselves, their Lark text and the compiled ones kept per tenant, are
serving's (gateway/serving/output_grammar.py, grammars.py): a `Job` arrives with its `Constraint`
built, having consumed the forced opening.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

# llguidance's words for running past a resource limit (serving/grammars.py sets the limits)
_LIMIT_ERROR = re.compile(r"items; max is|too many items|fuel|too many states|too big \(limit", re.IGNORECASE)


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


_LISTING = re.compile(r"\s*\d+ \| ")  # "   2 | answer: %json {...}": llguidance quoting the grammar


def matcher_error(matcher: Any) -> str:
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
    something, when there are any (serving/grammars.py `Grammars.closers`: the output, a string, a container, a
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
        reason = matcher_error(self.matcher)
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
