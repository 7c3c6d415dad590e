"""The openai Python SDK, unchanged, against toolkv: create, stream, the stream() helper, forced
calls, and a tool round trip whose second step hits the cached tool group."""

from __future__ import annotations

import json

import openai
import pydantic

from tests.clients.scenario import (
    FINAL_ANSWER,
    MODEL,
    ORDER_ARGS,
    ORDER_ID,
    TOOLS,
    USER_ARGS,
    ask,
    hermes_calls,
    tool_result,
)

TWO_CALLS = hermes_calls(("get_order_details", ORDER_ARGS), ("get_user_details", USER_ARGS))


def create(client: openai.OpenAI, reply: str, **extra):
    return client.chat.completions.create(model=MODEL, messages=ask(reply), tools=TOOLS, temperature=0,
                                          max_tokens=200, **extra)


def test_create_returns_parsed_tool_calls(client, openai_schema):
    resp = create(client, TWO_CALLS)
    openai_schema("CreateChatCompletionResponse", resp.model_dump(exclude_unset=True))
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_order_details", ORDER_ARGS), ("function", "get_user_details", USER_ARGS)]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


def test_stream_deltas_accumulate_to_the_same_calls(client):
    names, args, ids, finish = {}, {}, {}, None
    for chunk in create(client, TWO_CALLS, stream=True):
        if not chunk.choices:
            continue
        for part in chunk.choices[0].delta.tool_calls or ():
            if part.id:
                assert part.index not in ids, "a call's id and name come once"
                ids[part.index], names[part.index] = part.id, part.function.name
            args[part.index] = args.get(part.index, "") + (part.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(names[i], json.loads(args[i])) for i in sorted(names)] == [
        ("get_order_details", ORDER_ARGS), ("get_user_details", USER_ARGS)]


class GetOrderDetails(pydantic.BaseModel):
    """Get the status and details of an order."""

    order_id: str


def test_stream_helper_emits_argument_events_and_a_parsed_final_completion(client):
    tools = [openai.pydantic_function_tool(GetOrderDetails, name="get_order_details")]
    done_events = []
    with client.chat.completions.stream(model=MODEL, messages=ask(hermes_calls(("get_order_details", ORDER_ARGS))),
                                        tools=tools, temperature=0, max_tokens=200) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.done":
                done_events.append((event.name, event.parsed_arguments))
        final = stream.get_final_completion()
    assert done_events == [("get_order_details", GetOrderDetails(order_id=ORDER_ID))]
    [call] = final.choices[0].message.tool_calls
    assert call.function.parsed_arguments == GetOrderDetails(order_id=ORDER_ID)
    assert final.choices[0].finish_reason == "tool_calls"


def test_named_tool_choice_forces_the_call_and_parallel_false_keeps_one(client):
    continuation = json.dumps(ORDER_ARGS) + "}\n</tool_call>\n" + hermes_calls(("get_user_details", USER_ARGS))
    resp = create(client, continuation, parallel_tool_calls=False,
                  tool_choice={"type": "function", "function": {"name": "get_order_details"}})
    [call] = resp.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_order_details", ORDER_ARGS)


def test_tool_round_trip_answers_from_the_tool_result_and_hits_the_cache(client):
    messages = ask(hermes_calls(("get_order_details", ORDER_ARGS)))
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0)
    message = first.choices[0].message
    messages.append(message)  # the SDK's own message object goes back as it came
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": tool_result({"status": "delivered"}, FINAL_ANSWER)})
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0)
    assert second.choices[0].message.content == FINAL_ANSWER
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    assert second.usage.prompt_tokens_details.cached_tokens > 0
