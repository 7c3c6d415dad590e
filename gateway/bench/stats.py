"""Percentiles, millisecond spreads and ratios, shared by the report modules and the plots, and
how the report modules write a number or a ratio in a table."""

from __future__ import annotations

import math
from collections.abc import Iterable

from gateway.bench.client import Sample


def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def to_ms(value_s: float | None) -> float | None:
    return None if value_s is None else round(value_s * 1000, 1)


def ms_spread(values_s: list[float]) -> dict[str, float | None]:
    """p50 and p95 of durations in seconds, in ms."""
    return {"p50": to_ms(percentile(values_s, 50)), "p95": to_ms(percentile(values_s, 95))}


def ttft_stats(samples: list[Sample]) -> dict[str, float | None]:
    return ms_spread([s.ttft_s for s in samples if s.ttft_s is not None])


def output_tokens(sample: Sample) -> int:
    """The answer's tokens: usage's completion tokens, else the chunks that carried one."""
    return sample.completion_tokens if sample.completion_tokens is not None else sample.token_chunks


def decode_s_per_token(sample: Sample) -> float | None:
    """Seconds per output token after the first (None for fewer than two)."""
    tokens = output_tokens(sample)
    if sample.ttft_s is None or tokens < 2:
        return None
    return (sample.total_s - sample.ttft_s) / (tokens - 1)


def rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator to 2 decimals; None when either is missing or zero."""
    return round(numerator / denominator, 2) if numerator and denominator else None


def num(value: float | None, digits: int = 0) -> str:
    """A number as a table cell: thousands separated, '-' when not measured."""
    return "-" if value is None else f"{value:,.{digits}f}"


def times(value: float | None) -> str:
    """A ratio as a table cell: '1.25x', '-' when not measured."""
    return "-" if value is None else f"{value:.2f}x"
