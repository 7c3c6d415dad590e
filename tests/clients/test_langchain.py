"""langchain-openai, unchanged, against toolkv. On the scripted model: `ChatOpenAI(...).bind_tools`
invoke and stream, a forced tool, and the tool message round trip. On the real default model:
`bind_tools(..., tool_choice=...)` gives a call to a bound tool with schema-valid arguments, invoked
or streamed, and `with_structured_output(...)` returns the pydantic model (json_schema and
function_calling methods)."""

from __future__ import annotations

import json
from functools import reduce
from operator import add

import pytest
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tests.clients.forced import (
    CALL_MAX_TOKENS,
    CANCEL_REQUEST,
    DEFAULT_MODEL,
    RETAIL_FUNCTIONS,
    STATUS_REQUEST,
    STRUCTURED_REQUEST,
    CancellationRequest,
    assert_forced_exchange,
)
from tests.clients.forced import SYSTEM as RETAIL_SYSTEM
from tests.clients.scenario import (
    FINAL_ANSWER,
    MODEL,
    ORDER_ARGS,
    SYSTEM,
    USER_ARGS,
    hermes_calls,
    tool_result,
)
from tests.support.family_models import script


@tool
def get_order_details(order_id: str) -> str:
    """Get the status and details of an order."""
    return json.dumps({"order_id": order_id, "status": "delivered"})


@tool
def get_user_details(user_id: str) -> str:
    """Get the details of a user, including their orders."""
    return json.dumps({"user_id": user_id})


@pytest.fixture
def llm(scripted_server):
    return ChatOpenAI(base_url=scripted_server.api_url, api_key="unused", model=MODEL,
                                       temperature=0, max_retries=0, max_tokens=200)


def conversation(reply: str) -> list:
    return [SystemMessage(SYSTEM), HumanMessage(script(reply))]


def calls_of(message) -> list[tuple[str, dict]]:
    for call in message.tool_calls:
        assert call["id"].startswith("call_") and call["type"] == "tool_call"
    return [(c["name"], c["args"]) for c in message.tool_calls]


TWO_CALLS = hermes_calls(("get_order_details", ORDER_ARGS), ("get_user_details", USER_ARGS))
EXPECTED = [("get_order_details", ORDER_ARGS), ("get_user_details", USER_ARGS)]


def test_bind_tools_invoke_returns_tool_calls(llm):
    answer = llm.bind_tools([get_order_details, get_user_details]).invoke(conversation(TWO_CALLS))
    assert calls_of(answer) == EXPECTED
    assert answer.response_metadata["finish_reason"] == "tool_calls"
    assert not answer.invalid_tool_calls


def test_bind_tools_stream_chunks_add_up_to_the_same_calls(llm):
    chunks = list(llm.bind_tools([get_order_details, get_user_details]).stream(conversation(TWO_CALLS)))
    assert calls_of(reduce(add, chunks)) == EXPECTED


def test_forced_tool_and_round_trip_with_a_tool_message(llm):
    bound = llm.bind_tools([get_order_details, get_user_details], tool_choice="get_order_details",
                           parallel_tool_calls=False)
    history = conversation(json.dumps(ORDER_ARGS) + "}\n</tool_call>")
    first = bound.invoke(history)
    assert calls_of(first) == [("get_order_details", ORDER_ARGS)]
    [call] = first.tool_calls
    result = get_order_details.invoke(call["args"])
    history += [first, ToolMessage(tool_result(json.loads(result), FINAL_ANSWER),
                                                tool_call_id=call["id"])]
    second = llm.bind_tools([get_order_details, get_user_details]).invoke(history)
    assert second.content == FINAL_ANSWER and not second.tool_calls
    assert second.usage_metadata["input_token_details"]["cache_read"] > 0


# The real default model: forced tools and structured output.

@pytest.fixture
def real_llm(default_server):
    return ChatOpenAI(base_url=default_server.api_url, api_key="unused", model=DEFAULT_MODEL, temperature=0,
                      max_retries=0, max_tokens=CALL_MAX_TOKENS, timeout=300)


def retail_conversation(question: str) -> list:
    return [SystemMessage(RETAIL_SYSTEM), HumanMessage(question)]


def test_bind_tools_with_tool_choice_any_returns_a_valid_call(real_llm, wire):
    mark = len(wire.exchanges)
    answer = real_llm.bind_tools(RETAIL_FUNCTIONS, tool_choice="any").invoke(retail_conversation(CANCEL_REQUEST))
    assert answer.tool_calls and not answer.invalid_tool_calls, (answer.content, answer.invalid_tool_calls)
    [exchange] = wire.since(mark)
    sent = assert_forced_exchange(exchange)
    assert [(c["name"], c["args"]) for c in answer.tool_calls] == [(n, json.loads(a)) for n, a in sent]
    assert answer.response_metadata["finish_reason"] == "tool_calls"


def test_bind_tools_with_a_named_tool_streams_that_call(real_llm, wire):
    mark = len(wire.exchanges)
    bound = real_llm.bind_tools(RETAIL_FUNCTIONS, tool_choice="get_order_details", parallel_tool_calls=False)
    answer = reduce(add, bound.stream(retail_conversation(STATUS_REQUEST)))
    [exchange] = wire.since(mark)
    assert exchange.streamed
    assert assert_forced_exchange(exchange)[0][0] == "get_order_details"  # and streamed as OpenAI does
    assert [c["name"] for c in answer.tool_calls] == ["get_order_details"] and not answer.invalid_tool_calls


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_pydantic_model(real_llm, method):
    structured = real_llm.with_structured_output(CancellationRequest, method=method)
    assert isinstance(structured.invoke(retail_conversation(STRUCTURED_REQUEST)), CancellationRequest)
