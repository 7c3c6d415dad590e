"""Sampling edge cases found by fuzzing, and the text stream's stop handling."""

from __future__ import annotations

import pytest
import torch

from gateway.sampling import Sampler, SamplingParams


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
