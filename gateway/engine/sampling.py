"""Next-token choice (greedy, or temperature + top-p with an optional seed), with OpenAI's
`logit_bias`, presence/frequency penalties, a grammar's mask and logprobs: every row of a step on
the logits' device at once (`device_picks`), the per-row extras applied as tensors, and one
transfer of the picks to the host. The grammar's mask is computed on the CPU (constraints.py,
while the device runs the step) and applied on the device as a packed bitmask, as vLLM's
structured output does. The text the tokens write is sequence.py's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from gateway.engine.model_runner import staged

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


class Pick(NamedTuple):
    """A row's token, whether its logits were finite, and its logprobs when the row asked."""

    token: int
    finite: bool
    logprob: TokenLogprob | None = None


@dataclass(slots=True)
class Picks:
    """Each row's token (`best`, on the device) and what the host needs of it, on their way to the
    host: `read` waits for them alone (on CUDA an event after their copy to pinned memory, not a
    sync of the stream: work queued after them, a next step launched ahead, goes on)."""

    best: torch.Tensor
    host: list[torch.Tensor]  # tokens and finite flags [2, rows]; then the logprob rows' chosen, top values, top ids
    ready: Any  # torch.cuda.Event, or None: already on the host
    logprob_rows: tuple[tuple[int, int], ...] = ()  # (row, top_logprobs) of the rows that asked

    @classmethod
    def start(cls, best: torch.Tensor, finite: torch.Tensor, logprobs: list[torch.Tensor] | None = None,
              logprob_rows: tuple[tuple[int, int], ...] = ()) -> Picks:
        parts = [torch.stack([best, finite.long()]), *(logprobs or ())]
        if best.device.type != "cuda":
            return cls(best, parts, None, logprob_rows)
        host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in parts]
        for target, part in zip(host, parts, strict=True):
            target.copy_(part, non_blocking=True)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        ready.record()
        return cls(best, host, ready, logprob_rows)

    def read(self) -> list[Pick]:
        """Each row's pick."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens, finite = self.host[0].tolist()
        entries: dict[int, TokenLogprob] = {}
        if self.logprob_rows:
            chosen, values, ids = (t.tolist() for t in self.host[1:])
            for k, (row, top) in enumerate(self.logprob_rows):
                alternatives = tuple((i, v) for i, v in zip(ids[k][:top], values[k][:top], strict=True)
                                     if math.isfinite(v))
                entries[row] = TokenLogprob(tokens[row], chosen[k], alternatives)
        return [Pick(t, bool(f), entries.get(row)) for row, (t, f) in enumerate(zip(tokens, finite, strict=True))]


def device_picks(logits: torch.Tensor, samplers: list[Sampler],
                 masks: list[torch.Tensor | None] | None = None) -> Picks:
    """Each row's next token, chosen on the logits' device for all rows at once, in OpenAI's
    order: `logit_bias` added, presence/frequency penalties subtracted (each sequence's counts
    live on the device and count the pick there, so a step launched ahead penalizes the token not
    read yet), the grammar's mask (a packed bitmask per row: `masks[i]`, else the row's
    constraint's current one), the logprobs taken there (before temperature), then the argmax for
    a greedy row or temperature + top-p sampling for a sampled one; one argmax, one transfer.
    Every op is per row, so a row's token never depends on the rows beside it. A step of plain
    greedy rows is one argmax of the logits as they are."""
    finite = torch.isfinite(logits.amax(dim=-1))
    if all(s.plain for s in samplers):
        return Picks.start(torch.argmax(logits, dim=-1), finite)
    device = logits.device
    scores = logits.to(torch.float32, copy=True)  # the step's logits stay as they are
    _add_bias(scores, samplers)
    penalized_rows = [i for i, s in enumerate(samplers) if s.penalizes]
    if penalized_rows:
        _penalize(scores, penalized_rows, samplers)
    if masks is None:
        masks = [s.constraint.bitmask if s.constraint is not None else None for s in samplers]
    masked_rows = [i for i, m in enumerate(masks) if m is not None]
    if masked_rows:
        _mask(scores, masked_rows, [m for m in masks if m is not None])
    logprob_rows = tuple((i, s.params.top_logprobs) for i, s in enumerate(samplers) if s.params.logprobs)
    asked = staged([i for i, _ in logprob_rows], torch.long, device) if logprob_rows else None
    logprobs = torch.log_softmax(scores.index_select(0, asked), dim=-1) if asked is not None else None
    sampled = [i for i, s in enumerate(samplers) if s.params.temperature >= GREEDY_BELOW]
    if sampled:
        rows = staged(sampled, torch.long, device)
        scores.index_copy_(0, rows, sample_scores(scores.index_select(0, rows), [samplers[i] for i in sampled]))
    best = torch.argmax(scores, dim=-1)
    for i in penalized_rows:  # count the pick where it is: no read needed
        samplers[i].counted(best[i:i + 1])
    if logprobs is None or asked is None:
        return Picks.start(best, finite)
    chosen = logprobs.gather(1, best.index_select(0, asked)[:, None])[:, 0]
    top = min(max(1, *(k for _, k in logprob_rows)), logprobs.shape[-1])
    values, ids = torch.topk(logprobs, top, dim=-1)
    return Picks.start(best, finite, [chosen, values, ids], logprob_rows)


def _add_bias(scores: torch.Tensor, samplers: list[Sampler]) -> None:
    """OpenAI's `logit_bias`: each bias added to its token's logit, every row's at once."""
    triples = [(i, token, bias) for i, s in enumerate(samplers) for token, bias in s.params.logit_bias]
    if not triples:
        return
    rows, tokens, biases = zip(*triples, strict=True)
    device = scores.device
    index = (staged(list(rows), torch.long, device), staged(list(tokens), torch.long, device))
    scores.index_put_(index, staged(list(biases), torch.float32, device), accumulate=True)


def _penalize(scores: torch.Tensor, rows: list[int], samplers: list[Sampler]) -> None:
    device, vocab = scores.device, scores.shape[-1]
    counts = torch.stack([samplers[i].counts(vocab, device) for i in rows])
    frequency = staged([[samplers[i].params.frequency_penalty] for i in rows], torch.float32, device)
    presence = staged([[samplers[i].params.presence_penalty] for i in rows], torch.float32, device)
    index = staged(rows, torch.long, device)
    scores.index_copy_(0, index, penalized(scores.index_select(0, index), counts, frequency, presence))


def _mask(scores: torch.Tensor, rows: list[int], masks: list[torch.Tensor]) -> None:
    """Every token a row's bitmask forbids at -inf, with plain torch ops on the device (llguidance's
    own `apply_token_bitmask_inplace` is a `torch.compile` function whose first call compiled for
    72-83 s). A row whose every allowed token the model ruled out (-inf logits) takes the grammar's
    choice instead of an arbitrary token: its allowed tokens at 0."""
    device, vocab = scores.device, scores.shape[-1]
    words = torch.stack(masks)
    words = (words.pin_memory() if device.type == "cuda" else words).to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)  # made there: a host copy would wait for the step
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(rows), -1)
    if allowed.shape[1] < vocab:  # tokens past the grammar's vocabulary are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    allowed = allowed[:, :vocab]
    index = staged(rows, torch.long, device)
    masked = scores.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    dead = ~torch.isfinite(masked.amax(dim=-1, keepdim=True))
    grammar_only = torch.zeros_like(masked).masked_fill_(~allowed, float("-inf"))
    scores.index_copy_(0, index, torch.where(dead, grammar_only, masked))



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
        sampler.vocab = row.shape[0]
    return probs / noise.clamp_(min=torch.finfo(torch.float32).tiny)  # a draw of 0 would make an infinity


class Sampler:
    """One sequence's next-token choice: its parameters, its random stream (seeded by `seed`), its
    token counts for penalties (on the device) and its grammar, if it has one. `device_picks`
    chooses every row of a step together; the engine makes the grammar follow each token."""

    def __init__(self, params: SamplingParams, constraint: Constraint | None = None) -> None:
        self.params = params
        self.constraint = constraint
        self.seed = params.seed if params.seed is not None else torch.Generator().seed()
        self.penalizes = bool(params.frequency_penalty or params.presence_penalty)
        self._counts: torch.Tensor | None = None  # per token: how often this sequence sampled it
        self._noise: torch.Generator | None = None  # `noise_generator`'s
        self.vocab = 0  # the width of the noise it draws (known once it has drawn some)
        self.guess: torch.Tensor | None = None  # the mask a pick in flight was made with, guessed (`mark`)
        self._rewind_to: torch.Tensor | None = None  # the random stream's state before that pick
        self.last_logprob: TokenLogprob | None = None  # the last token's, when `params.logprobs` (next_token)

    @property
    def plain(self) -> bool:
        """Greedy with nothing to apply (no bias, penalty, grammar or logprobs): the next token is
        the argmax of the logits as they come."""
        return self.params.temperature < GREEDY_BELOW and not (
            self.params.logit_bias or self.penalizes or self.params.logprobs or self.constraint is not None)

    def noise_generator(self, device: torch.device) -> torch.Generator:
        """This sequence's random stream on `device` for sampling there: seeded like the sampler
        (the request's `seed`, else a random one), so a seed repeats its tokens."""
        if self._noise is None or self._noise.device != device:
            self._noise = torch.Generator(device=device)
            self._noise.manual_seed(self.seed)
        return self._noise

    def counts(self, vocab: int, device: torch.device) -> torch.Tensor:
        """How often this sequence has picked each token (for its penalties), on `device`."""
        if self._counts is None:
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        return self._counts

    def counted(self, token: torch.Tensor) -> None:
        """Count `token` (`[1]`, on the device) as picked."""
        if self._counts is not None:
            self._counts.index_put_((token,), torch.ones(1, device=token.device), accumulate=True)

    def skipped(self, token: int) -> None:
        """`token` was taken without a pick (forced by the grammar, fed in a chunk): it is counted
        for the penalties, and the noise a pick would have drawn for it is drawn and dropped, so a
        seed gives the tokens it gives when forced tokens are picked a step each."""
        if self._counts is not None:
            self._counts[token] += 1
        if self.params.temperature >= GREEDY_BELOW and self._noise is not None and self.vocab:
            torch.empty(self.vocab, device=self._noise.device).exponential_(generator=self._noise)

    def mark(self, device: torch.device, guessed: bool) -> None:
        """Before a pick: `guessed`, it is made with the grammar mask of the step before (a step
        launched ahead, engine/core.py `_decode_ahead`), kept in `guess` with where the random
        stream stood, so `dropped` can undo the pick; else no guess."""
        if not guessed or self.constraint is None:
            self.guess = None
            return
        self.guess = self.constraint.bitmask
        if self.params.temperature >= GREEDY_BELOW:
            self._rewind_to = self.noise_generator(device).get_state()

    def dropped(self, token: int) -> None:
        """Undo a pick made on a wrong guess: its penalty count taken back, the random stream
        back where it stood before it."""
        if self._counts is not None:
            self._counts[token] -= 1
        if self._rewind_to is not None and self._noise is not None:
            self._noise.set_state(self._rewind_to)
        self.guess = self._rewind_to = None

    def next_token(self, logits: torch.Tensor) -> int:
        """One row's pick (`logits [vocab]`) as the engine makes it, its grammar's mask computed
        first and the token followed after; NonFiniteLogits for logits no token can come from."""
        if self.constraint is not None:
            self.constraint.prepare()
        pick = device_picks(logits[None], [self]).read()[0]
        if not pick.finite:
            raise NonFiniteLogits("the model produced non-finite logits")
        self.last_logprob = pick.logprob
        if self.constraint is not None:
            self.constraint.accept(pick.token)
        return pick.token


def penalized(logits: torch.Tensor, counts: torch.Tensor, frequency: float | torch.Tensor,
              presence: float | torch.Tensor) -> torch.Tensor:
    """OpenAI's presence and frequency penalties: `logit[j] -= count[j] * frequency + (count[j] > 0)
    * presence`, `count` over the tokens generated so far. Own code because transformers'
    RepetitionPenaltyLogitsProcessor divides or multiplies a logit (CTRL's penalty) and counts the
    prompt too: a different definition."""
    return logits - counts * frequency - (counts > 0).to(counts.dtype) * presence


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
