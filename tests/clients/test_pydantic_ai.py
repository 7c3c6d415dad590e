"""pydantic-ai, unchanged, against toolkv on the real default model: structured output through its
output tool (a forced call) and through `NativeOutput` (`response_format` json_schema), and an agent
run whose first step is forced to call a function tool, which runs with valid arguments, before the
agent answers. `retries=0`: a user's first answer must be the valid one."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from pydantic_ai import Agent, NativeOutput, RunContext
from pydantic_ai.messages import RetryPromptPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

from tests.clients.forced import (
    CALL_MAX_TOKENS,
    CANCEL_REQUEST,
    DEFAULT_MODEL,
    RETAIL_FUNCTIONS,
    STATUS_REQUEST,
    STRUCTURED_REQUEST,
    SYSTEM,
    CancellationRequest,
    assert_forced_exchange,
    assert_valid_call,
)
from tests.clients.forced import get_order_details as order_details

SETTINGS = ModelSettings(temperature=0, max_tokens=CALL_MAX_TOKENS, max_retries=0, timeout=300)


@pytest.fixture
def model(default_server) -> OpenAIChatModel:
    return OpenAIChatModel(DEFAULT_MODEL, provider=OpenAIProvider(base_url=default_server.api_url, api_key="unused"))


def test_output_tool_returns_the_pydantic_model(model, wire):
    mark = len(wire.exchanges)
    agent = Agent(model, output_type=CancellationRequest, instructions=SYSTEM, model_settings=SETTINGS, retries=0)
    result = agent.run_sync(STRUCTURED_REQUEST)
    assert isinstance(result.output, CancellationRequest)
    [exchange] = wire.since(mark)
    assert_forced_exchange(exchange)  # the output tool is forced with tool_choice "required"


def test_native_output_returns_the_pydantic_model(model, wire):
    mark = len(wire.exchanges)
    agent = Agent(model, output_type=NativeOutput(CancellationRequest), instructions=SYSTEM, model_settings=SETTINGS,
                  retries=0)
    result = agent.run_sync(STRUCTURED_REQUEST)
    assert isinstance(result.output, CancellationRequest)
    [exchange] = wire.since(mark)
    assert exchange.request["response_format"]["type"] == "json_schema"


def test_a_forced_first_step_runs_the_tool_with_valid_arguments_then_answers(model, wire):
    ran: list[dict[str, Any]] = []

    def get_order_details(order_id: str) -> str:
        """Get the status and details of an order.

        Args:
            order_id: The order id, such as '#W0000000'.
        """
        ran.append({"order_id": order_id})
        return order_details(order_id)

    def call_the_tool_first(ctx: RunContext[None]) -> ModelSettings:
        return {**SETTINGS, "tool_choice": ["get_order_details"] if ctx.run_step == 1 else "none"}

    mark = len(wire.exchanges)
    agent = Agent(model, instructions=SYSTEM, tools=[get_order_details], model_settings=call_the_tool_first, retries=0)
    result = agent.run_sync(STATUS_REQUEST)
    first, answer = wire.since(mark)
    assert [json.loads(a) for _, a in assert_forced_exchange(first)] == ran and len(ran) == 1
    assert not [p for m in result.all_messages() for p in getattr(m, "parts", ()) if isinstance(p, RetryPromptPart)]
    assert isinstance(result.output, str) and result.output
    assert answer.body["choices"][0]["message"]["content"] == result.output


def test_a_step_restricted_to_some_tools_keeps_every_tool_and_calls_an_allowed_one(model, wire):
    """pydantic-ai restricts a step to some of its tools with `tool_choice: allowed_tools`, sending
    every tool still (so the prompt and its cache stay the same): the call is to an allowed tool,
    with valid arguments, and the next step's prompt hits the cache."""
    allowed = {"get_order_details", "get_user_details"}
    ran: list[str] = []

    def traced(function: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> str:
            ran.append(function.__name__)
            return str(function(*args, **kwargs))

        return functools.wraps(function)(run)

    def look_up_first(ctx: RunContext[None]) -> ModelSettings:
        return {**SETTINGS, "tool_choice": sorted(allowed) if ctx.run_step == 1 else "none"}

    mark = len(wire.exchanges)
    agent = Agent(model, instructions=SYSTEM, tools=[traced(f) for f in RETAIL_FUNCTIONS],
                  model_settings=look_up_first, retries=0)
    result = agent.run_sync(CANCEL_REQUEST)
    first, answer = wire.since(mark)
    choice = first.request["tool_choice"]
    assert choice["type"] == "allowed_tools" and choice["allowed_tools"]["mode"] == "required"
    assert {t["function"]["name"] for t in choice["allowed_tools"]["tools"]} == allowed
    assert len(first.request["tools"]) == len(RETAIL_FUNCTIONS)
    calls = first.body["choices"][0]["message"]["tool_calls"]
    for call in calls:
        assert call["function"]["name"] in allowed
        assert_valid_call(first.request["tools"], call["function"]["name"], call["function"]["arguments"])
    # pydantic-ai runs parallel calls concurrently (sync tools in threads): any order
    assert sorted(ran) == sorted(call["function"]["name"] for call in calls)
    assert answer.body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert isinstance(result.output, str) and result.output
