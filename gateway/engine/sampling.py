"""Next-token choice (greedy, or temperature + top-p with an optional seed), with OpenAI's
`logit_bias`, presence/frequency penalties and logprobs: on the device for many rows at once
where nothing but temperature and top-p applies, else per sequence on the host. The text the
tokens write is text_stream.py's."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers.generation.logits_process import SequenceBiasLogitsProcessor

from gateway.engine.staging import staged

if TYPE_CHECKING:
    from gateway.engine.constraints import Constraint

GREEDY_BELOW = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False  # record each token's logprob (and `top_logprobs` alternatives)
    top_logprobs: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids checked against the model


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's log probability and the most likely tokens at its position (most likely
    first), from the logits after logit_bias, penalties and the grammar mask, before temperature."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class NonFiniteLogits(Exception):
    """The model gave NaN or +inf logits (or only -inf): no token can be chosen from them."""


def all_finite(logits: torch.Tensor) -> bool:
    """Logits a token can be chosen from: no NaN, no +inf, and at least one finite value. -inf is
    how a logits processor masks a token out (a forced or constrained token), so it is allowed."""
    return bool(torch.isfinite(logits.max()))  # max is NaN if any is, +inf if any is, -inf if all are


@dataclass(slots=True)
class GreedyPicks:
    """Each logits row's argmax (`best`, on the device) and whether the row is finite, on their way
    to the host: `read` waits for them alone (on CUDA an event after their copy to pinned memory,
    not a sync of the stream: work queued after them, a next step launched ahead, goes on)."""

    best: torch.Tensor
    host: torch.Tensor
    ready: Any  # torch.cuda.Event, or None: already on the host

    @classmethod
    def start(cls, logits: torch.Tensor) -> GreedyPicks:
        best = torch.argmax(logits, dim=-1)
        picks = torch.stack([best, torch.isfinite(logits.amax(dim=-1)).long()])
        if logits.device.type != "cuda":
            return cls(best, picks, None)
        host = torch.empty(picks.shape, dtype=picks.dtype, pin_memory=True)
        host.copy_(picks, non_blocking=True)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        ready.record()
        return cls(best, host, ready)

    def read(self) -> list[tuple[int, int]]:
        """Each row's token and whether its logits were finite (1/0)."""
        if self.ready is not None:
            self.ready.synchronize()
        return list(zip(*self.host.tolist(), strict=True))


def device_picks(logits: torch.Tensor, samplers: list[Sampler]) -> GreedyPicks:
    """Each row's next token, chosen on the logits' device for all rows at once: the argmax for a
    plain greedy row, temperature + top-p sampling for a row sampled on the device (every sampler
    is one or the other): one argmax over the rows' scores and one transfer."""
    sampled = [i for i, sampler in enumerate(samplers) if not sampler.plain]
    if not sampled:
        return GreedyPicks.start(logits)
    rows = staged(sampled, torch.long, logits.device)
    scores = logits.to(torch.float32, copy=True)  # the step's logits stay as they are
    scores.index_copy_(0, rows, sample_scores(logits.index_select(0, rows), [samplers[i] for i in sampled]))
    return GreedyPicks.start(scores)


def picks_of(logits: torch.Tensor, samplers: list[Sampler], rows: list[int]) -> dict[int, tuple[int, int]]:
    """For the `rows` of a step's logits chosen on the device (`device_picks`): each one's token
    and whether its logits were finite (1/0)."""
    if not rows:
        return {}
    picked = logits if len(rows) == logits.shape[0] else logits.index_select(0, staged(rows, torch.long, logits.device))
    return dict(zip(rows, device_picks(picked, [samplers[i] for i in rows]).read(), strict=True))


def sample_scores(logits: torch.Tensor, samplers: list[Sampler]) -> torch.Tensor:
    """Scores whose row argmax is a sample of each row's distribution (temperature, then the top-p
    nucleus): the probabilities over noise drawn from each sequence's own generator, Exp(1) per
    token (the exponential race: the argmax of p_i / q_i is token i with probability p_i). Every
    step is per row, so a row's token never depends on the others batched with it."""
    device = logits.device
    temperature = staged([s.params.temperature for s in samplers], torch.float32, device)
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    if any(s.params.top_p < 1.0 for s in samplers):
        probs = nucleus_rows(probs, [s.params.top_p for s in samplers])
    noise = torch.empty_like(probs)
    for row, sampler in zip(noise, samplers, strict=True):
        row.exponential_(generator=sampler.noise_generator(device))
    return probs / noise.clamp_(min=torch.finfo(torch.float32).tiny)  # a draw of 0 would make an infinity


def on_host(logits: torch.Tensor) -> torch.Tensor:
    """Rows a sequence samples from itself (penalties, grammar, logprobs, temperature): on the CPU,
    where its sampler keeps its state, in one copy."""
    return logits.cpu() if logits.device.type != "cpu" else logits


class Sampler:
    """One sequence's next-token choice: the logits are checked, biased (`logit_bias`), penalized
    (presence/frequency, over this sequence's tokens so far), masked to its grammar (if it has
    one); the token's logprobs are recorded (when asked) from those logits; then the token is
    picked (greedy, or temperature + top-p) and the grammar follows it."""

    def __init__(self, params: SamplingParams, constraint: Constraint | None = None) -> None:
        self.params = params
        self.constraint = constraint
        self.constraint_s = 0.0  # the grammar's time (mask + follow) for the last token
        self._prepare_s = 0.0
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        # logit_bias is transformers' SequenceBiasLogitsProcessor with one-token sequences: it adds
        # each bias to its token's logit, which is OpenAI's definition.
        self._bias = SequenceBiasLogitsProcessor([[[token], float(bias)] for token, bias in params.logit_bias]) \
            if params.logit_bias else None
        self._no_input_ids = torch.empty((1, 0), dtype=torch.long)  # one-token biases never read the context
        self._penalize = bool(params.frequency_penalty or params.presence_penalty)
        self._counts: torch.Tensor | None = None  # per token: how often this sequence sampled it
        self.last_logprob: TokenLogprob | None = None  # the last token's, when `params.logprobs`
        self._noise: torch.Generator | None = None  # `noise_generator`'s

    @property
    def plain(self) -> bool:
        """Greedy with nothing to apply (no bias, penalty, grammar or logprobs): the next token is
        the argmax of the logits, which the engine takes for many rows at once on the device."""
        return self._unadjusted and self.params.temperature < GREEDY_BELOW

    @property
    def on_device(self) -> bool:
        """Temperature (and top-p) with nothing else to apply: the token is sampled on the logits'
        device, many rows at once (`device_picks`)."""
        return self._unadjusted and self.params.temperature >= GREEDY_BELOW

    @property
    def _unadjusted(self) -> bool:
        """No bias, penalty, logprobs or grammar: the logits are used as they come."""
        return self._bias is None and not self._penalize and not self.params.logprobs and self.constraint is None

    def noise_generator(self, device: torch.device) -> torch.Generator:
        """This sequence's random stream on `device` for sampling there: seeded like the sampler
        (the request's `seed`, else a random one), so a seed repeats its tokens."""
        if self._noise is None or self._noise.device != device:
            self._noise = torch.Generator(device=device)
            self._noise.manual_seed(self.generator.initial_seed())
        return self._noise

    def next_token(self, logits: torch.Tensor) -> int:
        """`logits`: [vocab] for the last position. Non-finite logits raise NonFiniteLogits
        (softmax would turn them into NaN probabilities, argmax into an arbitrary token)."""
        if self.on_device:  # as it is sampled in a batch
            token, finite = device_picks(logits[None], [self]).read()[0]
            if not finite:
                raise NonFiniteLogits("the model produced non-finite logits")
            return token
        if not all_finite(logits):
            raise NonFiniteLogits("the model produced non-finite logits")
        logits = self._adjusted(logits)
        if self.constraint is None:
            return self._choose(logits)
        started = time.perf_counter()
        logits = self.constraint.mask(logits)
        masked = time.perf_counter()
        token = self._choose(logits)
        accepting = time.perf_counter()
        self.constraint.accept(token)
        # the grammar's own cost: its mask (computed ahead, in `prepare_mask`, or here) and following the token
        self.constraint_s = self._prepare_s + (masked - started) + (time.perf_counter() - accepting)
        self._prepare_s = 0.0
        return token

    def prepare_mask(self) -> None:
        """Compute the grammar's mask for the next token ahead of the logits (the engine calls it
        while the device runs the forward). A grammar error is left for `next_token` to raise."""
        if self.constraint is None:
            return
        started = time.perf_counter()
        try:
            self.constraint.prepare()
        except Exception:  # raised again, where a failure belongs, when the token is chosen
            pass
        self._prepare_s += time.perf_counter() - started

    def _adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with the request's logit_bias and penalties (a copy; the same tensor if none)."""
        if self._bias is not None:
            logits = self._bias(self._no_input_ids, logits.unsqueeze(0))[0]
        if self._penalize:
            if self._counts is None:
                self._counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
            logits = penalized(logits, self._counts, self.params.frequency_penalty, self.params.presence_penalty)
        return logits

    def _choose(self, logits: torch.Tensor) -> int:
        """Pick from the processed logits; record the token's logprobs and count it."""
        token = self._pick(logits)
        if self.params.logprobs:  # only then: no log-softmax on the hot path
            self.last_logprob = token_logprob(logits, token, self.params.top_logprobs)
        if self._counts is not None:
            self._counts[token] += 1
        return token

    def _pick(self, logits: torch.Tensor) -> int:
        if self.params.temperature < GREEDY_BELOW:
            return int(torch.argmax(logits).item())
        probs = torch.softmax(logits.float().cpu() / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            probs = _top_p(probs, self.params.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator).item())


def penalized(logits: torch.Tensor, counts: torch.Tensor, frequency: float, presence: float) -> torch.Tensor:
    """OpenAI's presence and frequency penalties: `logit[j] -= count[j] * frequency + (count[j] > 0)
    * presence`, `count` over the tokens generated so far. Own code because transformers'
    RepetitionPenaltyLogitsProcessor divides or multiplies a logit (CTRL's penalty) and counts the
    prompt too: a different definition."""
    return logits - counts * frequency - (counts > 0).to(counts.dtype) * presence


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s log probability under `logits` and the `top` most likely tokens; a token masked
    out (-inf) is never among them."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        alternatives = tuple((i, v) for i, v in zip(ids.tolist(), values.tolist(), strict=True) if math.isfinite(v))
    return TokenLogprob(token, float(logprobs[token]), alternatives)


TOP_P_HEAD = 256  # the most likely tokens sorted first; the whole vocabulary only if they fall short


def nucleus_rows(probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """`probs [rows, vocab]` with each row cut to its top-p nucleus (the likeliest tokens whose
    probabilities reach top_p; not renormalised: only their ratios matter to the sampler); a row
    with top_p 1 is kept whole. The nucleus is a prefix of the tokens in order of probability, so
    on the CPU a row sorts only its `TOP_P_HEAD` likeliest when they reach its top_p (nearly
    always): a full sort of a 49k vocabulary cost 1-2 ms a token there, ~10 ms on a loaded
    machine. A GPU sorts every row whole (no host read in the way)."""
    p = staged(top_p, probs.dtype, probs.device)[:, None]
    if probs.device.type != "cpu" or probs.shape[-1] <= TOP_P_HEAD:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        return _nucleus_of(probs, sorted_probs, order, p)
    out = torch.zeros_like(probs)
    head, order = torch.topk(probs, TOP_P_HEAD, dim=-1)
    whole = head.sum(-1) < p[:, 0]
    inside = ~whole
    if bool(inside.any()):
        out[inside] = _nucleus_of(probs[inside], head[inside], order[inside], p[inside])
    if bool(whole.any()):
        sorted_probs, order = torch.sort(probs[whole], dim=-1, descending=True)
        out[whole] = _nucleus_of(probs[whole], sorted_probs, order, p[whole])
    return out


def _nucleus_of(probs: torch.Tensor, sorted_probs: torch.Tensor, order: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs < p) | (p >= 1.0)
    keep[:, 0] = True  # the top token always stays, even when top_p underflows float32 to 0
    return torch.zeros_like(probs).scatter(1, order, torch.where(keep, sorted_probs, 0.0))


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """One row's nucleus (`nucleus_rows`), renormalised."""
    filtered = nucleus_rows(probs[None], [top_p])[0]
    return filtered / filtered.sum()
