"""The bench's forced-tokens line: tokens the server's grammar forced per tool call, from
`toolkv_forced_tokens_total` around a scenario and the calls its streamed answers opened."""

from __future__ import annotations

import argparse

from gateway.bench.client import Sample, _calls_opened
from gateway.bench.forced import forced_lines, forced_tokens
from gateway.bench.options import register


def _sample(calls: int) -> Sample:
    return Sample("single", "main", 20, 0, "hit", False, 0.0, tool_calls=calls)


def test_a_calls_first_delta_opens_it_and_its_arguments_do_not():
    opening = {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f"}}]}}]}
    arguments = {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]}
    assert (_calls_opened(opening), _calls_opened(arguments), _calls_opened({"choices": []})) == (1, 0, 0)


def test_forced_tokens_per_call_and_its_line():
    before, after = {"toolkv_forced_tokens_total": 10.0}, {"toolkv_forced_tokens_total": 70.0}
    single = forced_tokens(before, after, [_sample(2), _sample(0), _sample(2)])
    assert single == {"tokens": 60, "calls": 4, "per_call": 15.0}
    peer = forced_tokens({}, {}, [_sample(1)])  # a server without the counter: unknown, not 0
    assert peer == {"tokens": None, "calls": 1, "per_call": None}
    [line] = forced_lines({"single": {"forced": single}, "agent": {"forced": peer}, "soak": {}})
    assert "single 15.0 over 4 calls" in line and "agent None tokens, 1 calls" in line


def test_the_bench_sends_tools_with_tool_choice_auto_by_default():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert parser.parse_args(["bench", "--spawn"]).tool_choice == "auto"
