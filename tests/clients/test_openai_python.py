"""The openai Python SDK, unchanged, against toolkv. On the scripted model: create, stream, the
stream() helper, forced calls, and a tool round trip whose second step hits the cached tool group.
On the real default model, what a user of the SDK relies on: `tool_choice` "required" or named gives
a call to a listed tool with schema-valid arguments (create, stream, the stream() helper), `parse()`
and `json_object` give JSON that parses, logprobs, `responses.create` / `responses.parse` and
`completions.create`."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pydantic

from tests.clients.forced import (
    CALL_MAX_TOKENS,
    CANCEL_REQUEST,
    DEFAULT_MODEL,
    MARKUP,
    RETAIL_SUBSET,
    STATUS_REQUEST,
    STRUCTURED_REQUEST,
    SYSTEM,
    CancellationRequest,
    assert_streamed_forced_call,
    assert_valid_call,
    messages,
    retail_tools,
)
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


# The real default model: forced and structured requests over six of tau-bench's retail tools.

RETAIL = retail_tools(*RETAIL_SUBSET)
GET_ORDER = {"type": "function", "function": {"name": "get_order_details"}}


def forced(client: openai.OpenAI, question: str, **extra):
    return client.chat.completions.create(model=DEFAULT_MODEL, messages=messages(question), tools=RETAIL,
                                          temperature=0, max_tokens=CALL_MAX_TOKENS, **extra)


def test_required_tool_choice_returns_a_call_to_a_listed_tool_with_valid_arguments(real_client):
    choice = forced(real_client, CANCEL_REQUEST, tool_choice="required").choices[0]
    assert choice.message.tool_calls, f"no call; content {choice.message.content!r}, finish {choice.finish_reason}"
    for call in choice.message.tool_calls:
        assert_valid_call(RETAIL, call.function.name, call.function.arguments)
    assert choice.finish_reason == "tool_calls" and not choice.message.content


def test_named_tool_choice_returns_that_tool_with_valid_arguments(real_client):
    choice = forced(real_client, STATUS_REQUEST, tool_choice=GET_ORDER, parallel_tool_calls=False).choices[0]
    assert choice.message.tool_calls, f"no call; content {choice.message.content!r}, finish {choice.finish_reason}"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_order_details"
    assert_valid_call(RETAIL, call.function.name, call.function.arguments)


def test_streamed_required_call_arrives_name_first_then_argument_fragments(real_client):
    stream = forced(real_client, CANCEL_REQUEST, tool_choice="required", stream=True)
    assert_streamed_forced_call(RETAIL, [chunk.model_dump(exclude_unset=True) for chunk in stream])


class CancelPendingOrder(pydantic.BaseModel):
    """Cancel a pending order."""

    order_id: str = pydantic.Field(description="The order id, such as '#W0000000'.")
    reason: Literal["no longer needed", "ordered by mistake"]


def test_stream_helper_with_a_forced_strict_tool_parses_its_arguments(real_client):
    tools = [openai.pydantic_function_tool(CancelPendingOrder, name="cancel_pending_order")]
    with real_client.chat.completions.stream(
            model=DEFAULT_MODEL, messages=messages(CANCEL_REQUEST), tools=tools, temperature=0,
            max_tokens=CALL_MAX_TOKENS, tool_choice={"type": "function", "function": {"name": "cancel_pending_order"}},
    ) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    text = "".join(e.delta for e in events if e.type == "content.delta")
    assert text == "", f"a forced call streamed text: {text!r}"
    assert [e.type for e in events].count("tool_calls.function.arguments.delta") >= 2, "arguments came in one delta"
    [done] = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert done.name == "cancel_pending_order" and isinstance(done.parsed_arguments, CancelPendingOrder)
    assert final.choices[0].finish_reason == "tool_calls"


def test_parse_with_a_pydantic_response_format_returns_the_parsed_model(real_client):
    completion = real_client.chat.completions.parse(
        model=DEFAULT_MODEL, messages=messages(STRUCTURED_REQUEST), response_format=CancellationRequest,
        temperature=0, max_tokens=CALL_MAX_TOKENS)
    message = completion.choices[0].message
    assert isinstance(message.parsed, CancellationRequest) and message.refusal is None
    assert completion.choices[0].finish_reason == "stop"


def test_json_object_response_format_returns_a_json_object(real_client):
    question = f"Answer with a JSON object holding the order id and the reason of: {CANCEL_REQUEST}"
    choice = real_client.chat.completions.create(
        model=DEFAULT_MODEL, messages=messages(question), response_format={"type": "json_object"},
        temperature=0, max_tokens=CALL_MAX_TOKENS).choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


def test_logprobs_give_each_token_and_its_top_alternatives(real_client):
    resp = real_client.chat.completions.create(
        model=DEFAULT_MODEL, messages=messages("Say hello."), temperature=0, max_tokens=4,
        logprobs=True, top_logprobs=2)
    entries = resp.choices[0].logprobs.content
    assert len(entries) == resp.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the likeliest


def response_tools(tools):
    return [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
             "parameters": t["function"]["parameters"], "strict": False} for t in tools]


def test_responses_create_with_required_tool_choice_returns_a_valid_function_call(real_client):
    resp = real_client.responses.create(
        model=DEFAULT_MODEL, instructions=SYSTEM, input=CANCEL_REQUEST, tools=response_tools(RETAIL),
        tool_choice="required", temperature=0, max_output_tokens=CALL_MAX_TOKENS)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert calls, f"no function_call item in {resp.output}"
    for call in calls:
        assert call.call_id and assert_valid_call(RETAIL, call.name, call.arguments) is not None
    assert resp.status == "completed" and resp.usage.input_tokens_details.cached_tokens >= 0


def test_responses_stream_a_named_call_as_argument_deltas(real_client):
    events = list(real_client.responses.create(
        model=DEFAULT_MODEL, instructions=SYSTEM, input=STATUS_REQUEST, tools=response_tools(RETAIL),
        tool_choice={"type": "function", "name": "get_order_details"}, temperature=0,
        max_output_tokens=CALL_MAX_TOKENS, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert kinds.count("response.function_call_arguments.delta") >= 2, "arguments came in one delta"
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert_valid_call(RETAIL, "get_order_details", done.arguments)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert not any(m in text for m in MARKUP), text


def test_responses_parse_returns_the_parsed_model(real_client):
    resp = real_client.responses.parse(
        model=DEFAULT_MODEL, instructions=SYSTEM, input=STRUCTURED_REQUEST, text_format=CancellationRequest,
        temperature=0, max_output_tokens=CALL_MAX_TOKENS)
    assert isinstance(resp.output_parsed, CancellationRequest)


def test_legacy_completions_create_continues_the_prompt(real_client):
    resp = real_client.completions.create(model=DEFAULT_MODEL, prompt="The capital of France is",
                                          temperature=0, max_tokens=6)
    choice = resp.choices[0]
    assert choice.text and choice.finish_reason in ("length", "stop")
    assert 0 < resp.usage.completion_tokens <= 6
