"""Sampling edge cases found by fuzzing, and the text stream's stop handling."""

from __future__ import annotations

import pytest
import torch

from gateway.engine.constraints import pack
from gateway.engine.sampling import (
    Sampler,
    SamplingParams,
    TokenLogprob,
    _nucleus_of,
    device_picks,
    nucleus_rows,
    penalized,
)
from gateway.engine.sequence import HeldLogprobs

pytestmark = pytest.mark.model_free  # no model, no server: in the fast subset


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-10])
@pytest.mark.parametrize("temperature", [1e-5, 0.7, 2.0])
def test_tiny_top_p_samples_the_top_token_instead_of_failing(top_p, temperature):
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3
    token = Sampler(SamplingParams(4, temperature, top_p, seed=1)).next_token(logits)
    assert token == int(torch.argmax(logits))


def test_same_seed_same_tokens_and_greedy_at_zero_temperature():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    draws = [[Sampler(SamplingParams(4, 1.0, 0.9, seed=7)).next_token(logits) for _ in range(5)] for _ in range(2)]
    assert draws[0] == draws[1]
    assert Sampler(SamplingParams(4, 0.0)).next_token(logits) == int(torch.argmax(logits))


def test_penalties_follow_openais_formula():
    """logit[j] -= count[j] * frequency + (count[j] > 0) * presence."""
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])
    counts = torch.tensor([0.0, 1.0, 3.0, 0.0, 2.0])
    out = penalized(logits, counts, frequency=0.5, presence=1.0)
    assert out.tolist() == [1.0, -0.5, -1.5, 1.0, -1.0]
    assert penalized(logits, counts, frequency=-0.5, presence=0.0).tolist() == [1.0, 1.5, 2.5, 1.0, 2.0]


def test_penalties_count_this_sequences_own_tokens_only():
    logits = torch.tensor([0.5, 0.4, 0.3, 0.2, 0.1])
    presence = Sampler(SamplingParams(8, 0.0, presence_penalty=1.0))
    assert [presence.next_token(logits) for _ in range(5)] == [0, 1, 2, 3, 4]  # each token is paid for once
    frequency = Sampler(SamplingParams(8, 0.0, frequency_penalty=0.15))
    # 0.5 (0 used) > 0.4; then 0.35 < 0.4; 0.4 (1) vs 0.35 (0) -> 1; ...: the count grows the penalty
    assert [frequency.next_token(logits) for _ in range(4)] == [0, 1, 0, 2]
    assert Sampler(SamplingParams(8, 0.0, presence_penalty=1.0)).next_token(logits) == 0  # a new sequence: no counts


class _BanFirst:
    """A grammar stub that allows every token but 0 (a packed bitmask, as constraints.Constraint's)."""

    def __init__(self) -> None:
        self.accepted: list[int] = []
        self.bitmask = pack(torch.arange(4) != 0)

    def prepare(self) -> None:
        pass

    def accept(self, token: int) -> None:
        self.accepted.append(token)


def test_bias_then_penalties_then_grammar_then_logprobs_before_temperature():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    params = SamplingParams(4, temperature=1.5, seed=3, logprobs=True, top_logprobs=4, presence_penalty=2.0,
                            logit_bias=((0, 100.0), (1, 5.0)))
    grammar = _BanFirst()
    sampler = Sampler(params, grammar)  # type: ignore[arg-type]
    token = sampler.next_token(logits)
    processed = torch.tensor([float("-inf"), 6.0, 2.0, 3.0])  # biased, then token 0 masked out
    expected = torch.log_softmax(processed, dim=-1)
    entry = sampler.last_logprob
    assert entry is not None and entry.token_id == token == grammar.accepted[0]
    assert entry.logprob == pytest.approx(float(expected[token]))  # from the logits before temperature
    assert [i for i, _ in entry.top] == [1, 3, 2]  # the masked token is never an alternative
    assert [lp for _, lp in entry.top] == pytest.approx([float(expected[i]) for i in (1, 3, 2)])
    second = sampler.next_token(logits)
    again = processed.clone()
    again[token] -= 2.0  # the presence penalty on the token just sampled
    assert sampler.last_logprob.logprob == pytest.approx(float(torch.log_softmax(again, dim=-1)[second]))


def test_no_logprobs_are_computed_unless_asked():
    sampler = Sampler(SamplingParams(4, 0.0))
    sampler.next_token(torch.tensor([0.0, 1.0]))
    assert sampler.last_logprob is None


def test_greedy_logprob_is_the_top_alternative():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    sampler = Sampler(SamplingParams(4, 0.0, logprobs=True, top_logprobs=20))
    token = sampler.next_token(logits)
    entry = sampler.last_logprob
    assert entry is not None and entry.top[0] == (token, entry.logprob) and len(entry.top) == 20
    assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)


def test_held_logprobs_go_with_the_text_that_ends_their_token_and_a_stop_drops_the_unsent():
    held = HeldLogprobs()
    a, b, c = (TokenLogprob(i, -1.0) for i in range(3))
    held.hold(a, 4)  # "abcd"
    held.hold(b, 7)  # "efg"
    assert held.release(5) == (a,)  # "abcde" sent: b's text is not all out yet
    assert held.release(6) == ()
    held.hold(c, 9)  # "hi"
    assert held.release(6, cut=True) == (b,)  # the stop starts at 6: b wrote some of the text, c none
    assert held.release(None) == ()


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])  # flat (the whole vocabulary is sorted) to peaked
@pytest.mark.parametrize("top_p", [0.1, 0.9, 0.999])
def test_top_p_sorting_only_the_likeliest_tokens_gives_the_full_sorts_nucleus(scale, top_p):
    from gateway.engine.sampling import _top_p

    probs = torch.softmax(torch.randn(49152, generator=torch.Generator().manual_seed(7)) * scale, dim=-1)
    full = _nucleus_of(probs[None], *torch.sort(probs[None], descending=True), torch.tensor([[top_p]]))[0]
    full = full / full.sum()
    assert torch.allclose(_top_p(probs, top_p), full, atol=1e-7)
    assert int((full > 0).sum()) >= 1


def _draws(sampler: Sampler, logits: torch.Tensor, count: int) -> torch.Tensor:
    return torch.bincount(torch.tensor([sampler.next_token(logits) for _ in range(count)]), minlength=len(logits))


def test_sampling_on_the_device_follows_temperature_and_the_nucleus():
    """The exponential race draws each token as often as its probability says: temperature
    first, then top-p keeps the likeliest tokens up to p and never the others."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(SamplingParams(4, temperature=1.0, seed=11))
    counts = _draws(sampler, logits, 4000).float() / 4000
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    nucleus = _draws(Sampler(SamplingParams(4, temperature=1.0, top_p=0.6, seed=11)), logits, 2000)
    assert nucleus[2:].sum() == 0 and abs(nucleus[0] / 2000 - 0.5 / 0.8) < 0.04  # {0, 1}, renormalised
    hot = _draws(Sampler(SamplingParams(4, temperature=2.0, seed=11)), logits, 4000).float() / 4000
    flattened = torch.softmax(logits / 2.0, dim=-1)
    assert torch.allclose(hot, flattened, atol=0.03)


def test_a_row_sampled_with_others_gets_the_token_it_gets_alone():
    """Batched sampling is per row: a seeded request's tokens do not depend on its neighbours,
    whose top_p (1, a head of the likeliest tokens, or the whole sorted vocabulary) differ."""
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 49152, generator=generator) * torch.tensor([[4.0], [0.05], [2.0], [1.0]])
    params = [SamplingParams(8, 0.9, 0.9, seed=5), SamplingParams(8, 1.3, 0.999, seed=6),
              SamplingParams(8, 0.7, 1.0, seed=7), SamplingParams(8, 1.0, 0.5, seed=8)]
    alone = [[Sampler(p).next_token(row) for _ in range(1)] for p, row in zip(params, logits, strict=True)]
    samplers = [Sampler(p) for p in params]
    batched = device_picks(logits, samplers).read()
    assert [[pick.token] for pick in batched] == alone
    assert all(pick.finite for pick in batched)


def test_the_nucleus_of_many_rows_is_each_rows_own():
    """On the CPU a row sorts only its head when that reaches top_p, else the whole vocabulary;
    either way the nucleus is the one a full sort gives."""
    probs = torch.softmax(torch.randn(3, 49152, generator=torch.Generator().manual_seed(9))
                          * torch.tensor([[6.0], [0.05], [3.0]]), dim=-1)
    top_p = [0.9, 0.95, 1.0]
    cut = nucleus_rows(probs, top_p)
    for row, p, kept in zip(probs, top_p, cut, strict=True):
        expected = _nucleus_of(row[None], *torch.sort(row[None], descending=True), torch.tensor([[p]]))[0]
        assert torch.equal(kept > 0, expected > 0)


def test_rows_with_bias_penalties_a_grammar_and_logprobs_are_chosen_together_as_alone():
    """Every kind of row in one batched pick (bias, penalties, a grammar's bitmask, logprobs,
    greedy and sampled): each row's token and logprobs are those it gets alone, token after token."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(2)) * 3
    ban = pack(torch.arange(300) % 3 != 0)  # a grammar that forbids every third token

    def samplers() -> list[Sampler]:
        grammar = _BanFirst()
        grammar.bitmask = ban
        return [Sampler(SamplingParams(8, 0.0, logit_bias=((7, 50.0),))),
                Sampler(SamplingParams(8, 0.8, 0.9, seed=1, frequency_penalty=1.5, presence_penalty=0.5)),
                Sampler(SamplingParams(8, 0.0, logprobs=True, top_logprobs=3), grammar),  # type: ignore[arg-type]
                Sampler(SamplingParams(8, 0.0)),
                Sampler(SamplingParams(8, 1.1, seed=2, logprobs=True))]

    alone_samplers, batch = samplers(), samplers()
    for _ in range(3):
        alone = [s.next_token(row) for s, row in zip(alone_samplers, logits, strict=True)]
        picks = device_picks(logits, batch).read()
        assert [p.token for p in picks] == alone
        assert [p.logprob for p in picks] == [s.last_logprob for s in alone_samplers]
    assert alone[0] == 7 and alone[2] % 3 != 0
    entry = picks[2].logprob
    assert entry is not None and len(entry.top) == 3 and all(token % 3 for token, _ in entry.top)
