"""How many of everything the lab's own scenarios send (history, constrained, fleet); the bench's
`Plan` (gateway/bench/context.py) has the rest, which the lab's scenarios read too."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LabPlan:
    history_tokens: int = 1_000_000  # history: prompt tokens to send, over all conversations
    history_window: int = 16  # conversations live at once
    history_turns: int = 8  # turns per conversation (~3,500 prompt tokens at the last with 5 tools)
    history_words: int = 300  # words per user message (~310 tokens)
    history_tools: int = 5
    history_max_tokens: int = 4
    constrained_max_tokens: int = 512  # a forced call or an answer cut by max_tokens is a failure
    fleet_groups: int = 4  # fleet: groups interleaved, one request at a time
    fleet_rounds: int = 5
    fleet_clients: int = 4  # the hot group's clients and the balanced case's (one group each)
    fleet_requests_per_client: int = 3  # measured, after a warming round

    @classmethod
    def of(cls, args: argparse.Namespace) -> LabPlan:
        """The plan --quick and the lab's options ask for; ValueError naming an option below 1."""
        plan = cls(history_tokens=100_000, fleet_requests_per_client=2) if args.quick else cls()
        named = {"history_tokens": args.history_tokens, "history_window": args.history_window,
                 "history_turns": args.history_turns, "constrained_max_tokens": args.constrained_max_tokens}
        if too_few := [f"--{k.replace('_', '-')}" for k, v in named.items() if v is not None and v < 1]:
            raise ValueError(f"{', '.join(too_few)} must be at least 1")
        return dataclasses.replace(plan, **{k: v for k, v in named.items() if v is not None})
