"""Next-token choice (greedy, or temperature + top-p with an optional seed) and the text stream
that turns tokens into text deltas while watching for stop sequences."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from gateway.constraints import Constraint

GREEDY_BELOW = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


class NonFiniteLogits(Exception):
    """The model gave NaN or +inf logits (or only -inf): no token can be chosen from them."""


def all_finite(logits: torch.Tensor) -> bool:
    """Logits a token can be chosen from: no NaN, no +inf, and at least one finite value. -inf is
    how a logits processor masks a token out (a forced or constrained token), so it is allowed."""
    return bool(torch.isfinite(logits.max()))  # max is NaN if any is, +inf if any is, -inf if all are


class Sampler:
    """One sequence's next-token choice: the logits are checked, masked to its grammar (if it has
    one), then the token is picked (greedy, or temperature + top-p); the grammar follows it."""

    def __init__(self, params: SamplingParams, constraint: Constraint | None = None) -> None:
        self.params = params
        self.constraint = constraint
        self.constraint_s = 0.0  # the grammar's time (mask + follow) for the last token
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def next_token(self, logits: torch.Tensor) -> int:
        """`logits`: [vocab] for the last position. Non-finite logits raise NonFiniteLogits
        (softmax would turn them into NaN probabilities, argmax into an arbitrary token)."""
        if not all_finite(logits):
            raise NonFiniteLogits("the model produced non-finite logits")
        if self.constraint is None:
            return self._choose(logits)
        started = time.perf_counter()
        logits = self.constraint.mask(logits)
        masked = time.perf_counter()
        token = self._choose(logits)
        accepting = time.perf_counter()
        self.constraint.accept(token)
        self.constraint_s = (masked - started) + (time.perf_counter() - accepting)  # the grammar's own cost
        return token

    def _choose(self, logits: torch.Tensor) -> int:
        if self.params.temperature < GREEDY_BELOW:
            return int(torch.argmax(logits).item())
        probs = torch.softmax(logits.float().cpu() / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            probs = _top_p(probs, self.params.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator).item())


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = torch.sort(probs, descending=True)
    keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
    keep[0] = True  # the top token always stays, even when top_p underflows float32 to 0
    sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    filtered = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return filtered / filtered.sum()


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class TextStream:
    """Accumulates generated tokens; yields only text that is final (complete characters, and not
    possibly the start of a stop sequence). `stopped` turns true once a stop sequence appears."""

    def __init__(self, decoder: Decoder, stop: tuple[str, ...],
                 special_ids: frozenset[int] = frozenset(), keep_ids: frozenset[int] = frozenset()) -> None:
        self.decoder = decoder
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.emitted_chars = 0
        self.stopped = False
        # Special tokens are dropped from the text, except the family's tool-call markers (a
        # Mistral model writes `[TOOL_CALLS]` as one special token, and the parser needs it).
        self.keep_ids = keep_ids
        self.hidden_ids = special_ids - keep_ids
        self._visible: list[int] = []

    def push(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        if token_id not in self.hidden_ids:
            self._visible.append(token_id)
        text = self._text()
        if text.endswith("\ufffd"):
            return ""  # a multi-byte character is not complete yet
        end = self._stop_at(text)
        if end is not None:
            self.stopped = True
            return self._take(text, end)
        return self._take(text, len(text) - self.holdback)

    def flush(self) -> str:
        if self.stopped:
            return ""
        text = self._text()
        return self._take(text, len(text))

    def _text(self) -> str:
        if not self.keep_ids:
            return self.decoder.decode(self.token_ids, skip_special_tokens=True)
        return self.decoder.decode(self._visible, skip_special_tokens=False)

    def _stop_at(self, text: str) -> int | None:
        start = max(0, self.emitted_chars - self.holdback)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _take(self, text: str, end: int) -> str:
        if end <= self.emitted_chars:
            return ""
        delta = text[self.emitted_chars : end]
        self.emitted_chars = end
        return delta
