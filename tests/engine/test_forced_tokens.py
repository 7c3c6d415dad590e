"""Forced tokens in one step (engine/outputs.py `_take_forced`): where a grammar allows one
continuation only, its tokens go to the model as one chunk with the token before them instead of
one decode step each. A forced call then takes far fewer forward passes than the tokens it writes,
and its tokens are those it gets with every forced token fed a step at a time."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.serving.runtime import Runtime
from tests.engine.conftest import Run, generate
from tests.engine.test_batching import run_together

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon", "Lille"]},
                                         "temperature_unit": {"enum": ["celsius", "fahrenheit"]},
                                         "forecast_days": {"enum": [1, 3, 7]}},
        "required": ["city", "temperature_unit", "forecast_days"]}
WEATHER = {"type": "function", "function": {"name": "weather_for_city", "description": "The weather in a city.",
                                            "parameters": CITY}}


def forced_call(tools: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": tools,
            "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0, "max_tokens": 80, **extra}


def answer(runtime: Runtime, request: dict[str, Any], chunked: bool) -> tuple[Run, int]:
    """The request's run and the forward passes its answer took after the prompt."""
    runtime.engine.chunk_forced = chunked
    before = runtime.engine.decode_steps
    run = generate(runtime, request)
    return run, runtime.engine.decode_steps - before


@pytest.mark.parametrize("extra", [{}, {"temperature": 0.9, "seed": 5, "logprobs": True, "top_logprobs": 2}],
                         ids=["greedy", "sampled-logprobs"])
def test_a_forced_call_takes_fewer_passes_than_tokens_and_writes_the_tokens_of_one_step_each(runtime_for, extra):
    runtime = runtime_for("llama")
    request = forced_call([WEATHER], **extra)
    step_each, step_passes = answer(runtime, request, chunked=False)
    chunked, chunk_passes = answer(runtime, request, chunked=True)
    assert chunked.finished.token_ids == step_each.finished.token_ids
    assert chunked.text == step_each.text and chunked.text.startswith('{"city": "')  # the name is in the prompt
    tokens = chunked.finished.completion_tokens
    assert step_passes >= tokens - 1  # a step a token (the first comes from the prompt's pass)
    assert chunk_passes <= 0.7 * tokens  # at least 30% fewer forward passes than tokens
    if extra.get("logprobs"):  # a forced token's logprob is the masked distribution's: 0, alone in its top
        assert [e.token_id for e in chunked.logprobs] == [e.token_id for e in step_each.logprobs]
        forced = [e for e in step_each.logprobs if e.logprob == 0.0]
        assert forced and all(e.top == ((e.token_id, 0.0),) for e in forced)
        assert [e.logprob for e in chunked.logprobs] == pytest.approx([e.logprob for e in step_each.logprobs],
                                                                      abs=1e-4)


def test_forced_chunks_beside_other_requests_give_each_the_tokens_it_gets_alone(runtime_for, merchant_tools):
    """A forced call's chunks in a batch with plain decodes and a prompt: with batch_invariant
    (the CPU's default) every request writes what it writes alone."""
    runtime = runtime_for("llama")
    tools = [WEATHER, *merchant_tools[:2]]
    requests = [forced_call(tools), forced_call(tools, max_tokens=9),
                {**forced_call(tools), "tool_choice": "none", "max_tokens": 30},
                {**forced_call(tools), "tool_choice": "auto", "max_tokens": 30}]
    alone = [generate(runtime, r).finished for r in requests]
    together = run_together(runtime, [(r, False) for r in requests])
    assert [run.finished for run in together] == alone
    assert alone[1].finish_reason == "length" and alone[1].completion_tokens == 9
    assert runtime.engine.stats().forced_tokens_total > 0
