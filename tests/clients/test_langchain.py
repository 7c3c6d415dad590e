"""langchain-openai, unchanged, against toolkv: `ChatOpenAI(...).bind_tools` invoke and stream,
a forced tool, and the tool message round trip."""

from __future__ import annotations

import json
from functools import reduce
from operator import add

import pytest
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tests.clients.scenario import (
    FINAL_ANSWER,
    MODEL,
    ORDER_ARGS,
    SYSTEM,
    USER_ARGS,
    hermes_calls,
    tool_result,
)
from tests.tools.models import script


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
