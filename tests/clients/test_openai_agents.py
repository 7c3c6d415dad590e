"""The openai-agents SDK, unchanged, against toolkv on the real default model, with its default
Responses model (`OpenAIResponsesModel`, POST /v1/responses) and with `OpenAIChatCompletionsModel`:
an agent forced to use its tool runs it with valid arguments and finishes with the tool's result,
run and streamed, and an agent with an `output_type` finishes with that pydantic model."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
)
from openai import AsyncOpenAI

from tests.clients.forced import (
    CALL_MAX_TOKENS,
    DEFAULT_MODEL,
    MARKUP,
    STATUS_REQUEST,
    STRUCTURED_REQUEST,
    SYSTEM,
    CancellationRequest,
    assert_forced_exchange,
)
from tests.clients.forced import get_order_details as order_details

RUN = RunConfig(tracing_disabled=True)  # the default exports traces to OpenAI
MODEL_CLASSES = {"/v1/responses": OpenAIResponsesModel, "/v1/chat/completions": OpenAIChatCompletionsModel}


@pytest.fixture(params=list(MODEL_CLASSES), ids=["responses_model", "chat_completions_model"])
def model_and_path(request, default_server) -> tuple[Any, str]:
    client = AsyncOpenAI(base_url=default_server.api_url, api_key="unused", max_retries=0, timeout=300)
    return MODEL_CLASSES[request.param](model=DEFAULT_MODEL, openai_client=client), request.param


def retail_agent(model: Any, ran: list[str]) -> Agent:
    @function_tool
    def get_order_details(order_id: str) -> str:
        """Get the status and details of an order.

        Args:
            order_id: The order id, such as '#W0000000'.
        """
        ran.append(order_id)
        return order_details(order_id)

    return Agent(name="retail", instructions=SYSTEM, model=model, tools=[get_order_details],
                 model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=CALL_MAX_TOKENS),
                 tool_use_behavior="stop_on_first_tool")


def test_agent_runs_the_forced_tool_and_finishes_with_its_result(model_and_path, wire):
    model, path = model_and_path
    ran: list[str] = []
    mark = len(wire.exchanges)
    result = Runner.run_sync(retail_agent(model, ran), STATUS_REQUEST, run_config=RUN, max_turns=2)
    [exchange] = wire.since(mark, path)
    assert_forced_exchange(exchange)
    assert len(ran) == 1 and result.final_output == order_details(ran[0])


async def run_streamed(agent: Agent, question: str) -> tuple[Any, list[Any]]:
    result = Runner.run_streamed(agent, question, run_config=RUN, max_turns=2)
    return result, [event async for event in result.stream_events()]


def test_streamed_agent_runs_the_forced_tool_with_no_markup_in_its_text(model_and_path, wire):
    model, path = model_and_path
    ran: list[str] = []
    mark = len(wire.exchanges)
    result, events = asyncio.run(run_streamed(retail_agent(model, ran), STATUS_REQUEST))
    [exchange] = wire.since(mark, path)
    assert exchange.streamed
    assert_forced_exchange(exchange)  # for chat: name first, then argument fragments
    text = "".join(getattr(e.data, "delta", "") for e in events
                   if e.type == "raw_response_event" and e.data.type == "response.output_text.delta")
    assert not any(m in text for m in MARKUP), text
    assert [e.name for e in events if e.type == "run_item_stream_event"][:2] == ["tool_called", "tool_output"]
    assert len(ran) == 1 and result.final_output == order_details(ran[0])


def test_agent_with_an_output_type_finishes_with_that_model(model_and_path):
    model, _ = model_and_path
    agent = Agent(name="extractor", instructions=SYSTEM, model=model, output_type=CancellationRequest,
                  model_settings=ModelSettings(temperature=0, max_tokens=CALL_MAX_TOKENS))
    result = Runner.run_sync(agent, STRUCTURED_REQUEST, run_config=RUN, max_turns=1)
    assert isinstance(result.final_output, CancellationRequest)
