"""The Responses API (`POST /v1/responses`) as the openai SDK sees it: response objects and every
stream event validated with the SDK's own types, usage with cached tokens, the streaming event
order and numbering, `previous_response_id` (continued, not kept with `store: false`, not
visible to another API key), structured output, and errors in OpenAI's envelope naming the field.
Tool calls come from the scripted model (it writes the call its prompt asks for)."""

from __future__ import annotations

import json
import typing
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from gateway.api.app import create_app
from gateway.settings import load_settings
from tests.api.conftest import RESPONSES_KEYS
from tests.clients.scenario import ORDER_ARGS, ORDER_ID, hermes_calls, tool_result
from tests.support.family_models import script, scripted_runtime
from tests.support.server import serve_app
from tests.support.waiting import wait_until

MODEL = "tiny-llama"
INSTRUCTIONS = "You are a merchant assistant."
KEYS = RESPONSES_KEYS
EVENT_TYPES = {cls.model_fields["type"].annotation.__args__[0]: cls
               for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
ORDER_TOOL = {"type": "function", "name": "get_order_details", "description": "Get the details of an order.",
              "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                             "required": ["order_id"], "additionalProperties": False}, "strict": True}


def flat(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat-shaped tools in the Responses' flat shape."""
    return [{"type": "function", **t["function"]} for t in tools]


def validated(body: dict[str, Any]) -> Response:
    return Response.model_validate(body, strict=True)


def post(live, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(live.api_url + "/responses", json=body, headers=headers, timeout=60)


def stream_events(live, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's events; each `event:` line names its data's type, and validates as that type."""
    with httpx.stream("POST", live.api_url + "/responses", json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line for line in resp.iter_lines() if line.startswith(("event: ", "data: "))]
    names, events = lines[0::2], [json.loads(line[len("data: "):]) for line in lines[1::2]]
    for name, event in zip(names, events, strict=True):
        assert name == f"event: {event['type']}"
        EVENT_TYPES[event["type"]].model_validate(event, strict=True)
    return events


# ---- the random-weight model -------------------------------------------------------------------


def test_text_input_returns_an_openai_response_with_usage(live):
    resp = post(live, {"model": MODEL, "input": "What was GMV last week?", "instructions": INSTRUCTIONS,
                       "max_output_tokens": 6, "temperature": 0, "metadata": {"run": "1"}})
    assert resp.status_code == 200, resp.text
    body = validated(resp.json())
    assert body.id.startswith("resp_") and body.object == "response" and body.model == MODEL
    [message] = body.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [part] = message.content
    assert part.type == "output_text" and part.annotations == [] and part.text == body.output_text
    usage = body.usage
    assert usage.output_tokens <= 6 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    if body.status == "incomplete":  # random weights rarely end on their own
        assert usage.output_tokens == 6 and body.incomplete_details.reason == "max_output_tokens"
        assert message.status == "incomplete"
    else:
        assert body.status == "completed" and body.incomplete_details is None
    assert (body.instructions, body.max_output_tokens, body.temperature, body.metadata) == (
        INSTRUCTIONS, 6, 0, {"run": "1"})
    assert body.store is True and body.tool_choice == "auto" and body.parallel_tool_calls is True


def test_the_tool_group_is_cached_as_for_chat(client, merchant_tools):
    """The second request with the same instructions and tools reads the group from the cache."""
    args = dict(model=MODEL, instructions=INSTRUCTIONS, tools=flat(merchant_tools[20:25]), tool_choice="none",
                temperature=0, max_output_tokens=3)
    first = client.responses.with_raw_response.create(input="GMV?", **args)
    second = client.responses.with_raw_response.create(input="Refunds?", **args)
    assert (first.headers["x-toolkv-cache"], second.headers["x-toolkv-cache"]) == ("miss", "hit")
    cold, warm = first.parse().usage, second.parse().usage
    assert cold.input_tokens_details.cached_tokens == 0 < cold.input_tokens_details.cache_write_tokens
    assert 0 < warm.input_tokens_details.cached_tokens < warm.input_tokens
    assert warm.input_tokens_details.cache_write_tokens == 0


def test_input_items_of_every_supported_kind_are_accepted(client):
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Look up order 7"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_order", "arguments": "{\"id\": 7}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "{\"status\": \"shipped\"}"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "It shipped.", "annotations": []}]},
        {"role": "system", "content": "Answer in English."},
        {"role": "user", "content": "Thanks"},
    ]
    resp = client.responses.create(model=MODEL, input=items, max_output_tokens=3, temperature=0, top_p=0.5,
                                   user="u1", prompt_cache_key="k", extra_body={"some_vendor_field": True})
    assert resp.status in ("completed", "incomplete") and resp.usage.input_tokens > 0


def test_stream_events_come_in_openai_order_and_are_numbered(live):
    body = {"model": MODEL, "input": "Top products?", "instructions": INSTRUCTIONS, "max_output_tokens": 8,
            "temperature": 0}
    events = stream_events(live, body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    last = "response.incomplete" if events[-1]["response"]["status"] == "incomplete" else "response.completed"
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", last]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert events[kinds.index("response.output_text.done")]["text"] == text
    final = validated(events[-1]["response"])
    assert final.output_text == text and final.status == last.removeprefix("response.")
    assert final.usage.output_tokens == 8 or final.status == "completed"
    assert final.id == events[0]["response"]["id"] and final.output[0].id == events[2]["item"]["id"]
    whole = validated(post(live, body).json())
    assert whole.output_text == text and whole.usage.output_tokens == final.usage.output_tokens


def test_sdk_stream_yields_typed_events(client):
    stream = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, temperature=0, stream=True)
    events = list(stream)
    assert events[0].type == "response.created" and events[-1].type in ("response.completed",
                                                                        "response.incomplete")
    assert events[-1].response.usage.output_tokens <= 4


def test_previous_response_id_continues_the_conversation(client):
    args = dict(model=MODEL, instructions=INSTRUCTIONS, temperature=0, max_output_tokens=6)
    first = client.responses.create(input="My name is Ada and I sell shoes.", **args)
    second = client.responses.create(input="What is my name?", previous_response_id=first.id, **args)
    third = client.responses.create(input="And what do I sell?", previous_response_id=second.id, **args)
    assert second.previous_response_id == first.id
    # each prompt holds the turns before it: the earlier input, the answer, then the new input
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert third.usage.input_tokens_details.cached_tokens > second.usage.input_tokens_details.cached_tokens


def test_a_streamed_response_can_be_continued(live, client):
    events = stream_events(live, {"model": MODEL, "input": "Hi there", "max_output_tokens": 4, "temperature": 0})
    first = events[-1]["response"]
    second = client.responses.create(model=MODEL, input="Go on", previous_response_id=first["id"],
                                     max_output_tokens=4, temperature=0)
    assert second.usage.input_tokens > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]


def requests_counted(live, status: str, stream: str) -> float:
    return float(live.app.state.gateway.metrics.requests.labels(status=status, stream=stream)._value.get())


def test_a_streaming_client_that_hangs_up_stops_its_generation(live):
    engine = live.app.state.gateway.model.runtime.engine
    cancelled, hangups = engine.num_cancelled, requests_counted(live, "499", "true")
    body = {"model": MODEL, "input": "Count forever", "max_output_tokens": 3000, "stream": True,
            "temperature": 0}  # greedy runs to the limit; a sampled answer might end before the hang-up
    with httpx.stream("POST", live.api_url + "/responses", json=body, timeout=60) as resp:
        next(line for line in resp.iter_lines() if line.startswith("data: "))
    assert wait_until(lambda: requests_counted(live, "499", "true") == hangups + 1)
    assert wait_until(lambda: engine.num_cancelled == cancelled + 1)


def test_store_false_keeps_nothing_to_continue(live):
    first = post(live, {"model": MODEL, "input": "Remember 42", "max_output_tokens": 2, "store": False}).json()
    assert first["store"] is False
    resp = post(live, {"model": MODEL, "input": "What was it?", "previous_response_id": first["id"]})
    assert resp.status_code == 400
    assert resp.json()["error"] == {"message": f"Previous response with id '{first['id']}' not found.",
                                    "type": "invalid_request_error", "param": "previous_response_id",
                                    "code": "previous_response_not_found"}


def test_structured_output_is_json_valid_for_the_schema(client):
    from jsonschema import validate

    schema = {"type": "object", "properties": {"in_stock": {"type": "boolean"}}, "required": ["in_stock"],
              "additionalProperties": False}
    resp = client.responses.create(
        model=MODEL, input="Is the red shoe in stock?", temperature=0, max_output_tokens=64,
        text={"format": {"type": "json_schema", "name": "stock", "schema": schema, "strict": True}})
    assert resp.status == "completed", resp.output_text
    validate(json.loads(resp.output_text), schema)
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "stock"


@pytest.mark.parametrize("body, status, param, code", [
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type", "unsupported_parameter"),
    ({"tools": [{"type": "function", "name": "f", "defer_loading": True}]}, 400, "tools[0].defer_loading",
     "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, 400,
     "input[0].content[0].type", "unsupported_parameter"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type", "unsupported_parameter"),
    ({"reasoning": {"effort": "high"}}, 400, "reasoning", "unsupported_parameter"),
    ({"include": ["reasoning.encrypted_content"]}, 400, "include[0]", "unsupported_parameter"),
    ({"include": ["message.output_text.logprobs", "web_search_call.results"]}, 400, "include[1]",
     "unsupported_parameter"),
    ({"include": "message.output_text.logprobs"}, 400, "include", None),
    ({"background": True}, 400, "background", "unsupported_parameter"),
    ({"conversation": "conv_1"}, 400, "conversation", "unsupported_parameter"),
    ({"top_logprobs": 21}, 400, "top_logprobs", None),
    ({"top_logprobs": -1}, 400, "top_logprobs", None),
    ({"top_logprobs": True}, 400, "top_logprobs", None),
    ({"truncation": "auto"}, 400, "truncation", "unsupported_parameter"),
    ({"text": {"verbosity": "low"}}, 400, "text.verbosity", "unsupported_parameter"),
    ({"tool_choice": {"type": "file_search"}}, 400, "tool_choice", "unsupported_parameter"),
    ({"temperature": "hot"}, 400, "temperature", None),
    ({"input": [{"role": "wizard", "content": "hi"}]}, 400, "input[0].role", None),
    ({"tools": [{"type": "function", "name": "bad name"}]}, 400, "tools[0].name", None),
    ({"tools": [{"type": "function", "name": "a"}], "tool_choice": {"type": "function", "name": "b"}}, 400,
     "tool_choice", None),
    ({"max_output_tokens": 10**9}, 400, "max_output_tokens", "context_length_exceeded"),
    ({"model": "gpt-9"}, 404, "model", "model_not_found"),
    ({"input": None}, 400, "input", None),
    ({"previous_response_id": "resp_nope"}, 400, "previous_response_id", "previous_response_not_found"),
    ({"input": [{"id": "msg_1", "role": "user", "content": "a"}, {"id": "msg_1", "role": "user", "content": "b"}]},
     400, "input[1].id", None),  # its stored items page by id: a repeat looped `input_items` forever
    ({"input": [{"id": {"a": 1}, "role": "user", "content": "a"}]}, 400, "input[0].id", None),  # was a 500
    ({"tools": [{"type": "function", "name": "a", "parameters": {"type": "integer"}}]}, 400, "tools[0].parameters",
     None),
    ({"stream_options": {"include_obfuscation": False}}, 400, "stream_options", None),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, 400, "text.format.name", None),  # not .json_schema.
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata", None),  # OpenAI's 16 pairs
    ({"metadata": {"note": "v" * 513}}, 400, "metadata.note", None),
])
def test_bad_requests_get_openai_error_envelopes_naming_the_field(live, body, status, param, code):
    resp = post(live, {"model": MODEL, "input": "hi", **body})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert code is None or error["code"] == code


def test_an_error_found_on_the_chat_side_names_the_responses_field_in_its_message_too(live):
    twice = [{"type": "function", "name": "a"}, {"type": "function", "name": "a"}]
    error = post(live, {"model": MODEL, "input": "hi", "tools": twice}).json()["error"]
    assert error["param"] == "tools[1].name"
    assert error["message"].startswith("tools[1].name 'a' appears twice")


# ---- logprobs -----------------------------------------------------------------------------------

LOGPROBS = ["message.output_text.logprobs"]


def spelled(entries: list[dict[str, Any]]) -> str:
    return b"".join(bytes(e["bytes"]) for e in entries).decode()


def test_output_text_logprobs_are_chats_for_the_same_request(client):
    """The Responses request runs as its chat request: the same tokens, logprobs and alternatives."""
    raw = client.responses.with_raw_response.create(model=MODEL, input="Say hello", instructions=INSTRUCTIONS,
                                                    temperature=0, max_output_tokens=8, top_logprobs=3,
                                                    include=LOGPROBS)
    validated(raw.http_response.json())
    resp = raw.parse()
    [part] = resp.output[0].content
    entries = [lp.model_dump() for lp in part.logprobs]
    assert len(entries) == resp.usage.output_tokens and spelled(entries) == part.text == resp.output_text
    assert resp.top_logprobs == 3
    for lp in part.logprobs:
        assert [t.logprob for t in lp.top_logprobs] == sorted((t.logprob for t in lp.top_logprobs), reverse=True)
        assert len(lp.top_logprobs) == 3 and lp.top_logprobs[0].token == lp.token  # greedy: the top one
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Say hello"}],
        temperature=0, max_completion_tokens=8, logprobs=True, top_logprobs=3)
    expected = chat.choices[0].logprobs.content
    assert [e["token"] for e in entries] == [t.token for t in expected]
    assert [e["logprob"] for e in entries] == pytest.approx([t.logprob for t in expected], abs=1e-4)


def test_streamed_logprobs_follow_each_delta_and_add_up_to_the_whole_answers(live):
    body = {"model": MODEL, "input": "Tell me a story", "temperature": 0, "max_output_tokens": 8,
            "top_logprobs": 2, "include": LOGPROBS}
    events = stream_events(live, body)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    for delta in deltas:
        assert spelled(delta["logprobs"]) == delta["delta"]  # a delta's tokens wrote exactly its text
        assert all(len(entry["top_logprobs"]) == 2 for entry in delta["logprobs"])
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    streamed = [entry for delta in deltas for entry in delta["logprobs"]]
    assert streamed and done["logprobs"][:len(streamed)] == streamed and spelled(done["logprobs"]) == done["text"]
    final = validated(events[-1]["response"])
    assert final.output[0].content[0].model_dump()["logprobs"] == done["logprobs"]
    whole = post(live, body).json()["output"][0]["content"][0]["logprobs"]
    assert [e["token"] for e in whole] == [e["token"] for e in done["logprobs"]]
    assert [e["logprob"] for e in whole] == pytest.approx([e["logprob"] for e in done["logprobs"]], abs=1e-4)


def test_without_the_include_value_there_are_no_logprobs_as_openais(client):
    resp = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0, top_logprobs=2)
    assert resp.output[0].content[0].logprobs == [] and resp.top_logprobs == 2


def test_sdk_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_missing")
    assert info.value.body["param"] == "previous_response_id"


# ---- tenants -----------------------------------------------------------------------------------


def test_a_response_id_is_only_visible_to_its_own_api_key(secured):
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 2}
    mine = post(secured, body, KEYS[0]).json()["id"]
    other = post(secured, {**body, "previous_response_id": mine}, KEYS[1])
    assert other.status_code == 400 and other.json()["error"]["param"] == "previous_response_id"
    assert post(secured, {**body, "previous_response_id": mine}, KEYS[0]).status_code == 200


def test_the_store_keeps_the_last_responses_of_each_key(secured):
    """`max_stored_responses` = 2 per key: a third response drops the least recently used."""
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 1}
    oldest, middle = (post(secured, body, KEYS[1]).json()["id"] for _ in range(2))
    assert post(secured, {**body, "previous_response_id": oldest}, KEYS[1]).status_code == 200  # now recent
    assert post(secured, {**body, "previous_response_id": middle}, KEYS[1]).status_code == 400


# ---- the scripted model: tool calls ------------------------------------------------------------


@pytest.fixture(scope="module")
def scripted(tiny_model_dir, tmp_path_factory):
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "served_model_name": MODEL,
                                        "min_prefix_tokens": 8, "disk_budget_bytes": 0,
                                        "cache_dir": str(tmp_path_factory.mktemp("cache"))}, environ={})
    with serve_app(create_app(settings, scripted_runtime)) as live:
        yield live


@pytest.fixture
def scripted_client(scripted) -> openai.OpenAI:
    return openai.OpenAI(base_url=scripted.api_url, api_key="unused", max_retries=0)


def test_a_call_is_a_function_call_item_and_its_output_continues_the_turn(scripted_client):
    reply = hermes_calls(("get_order_details", ORDER_ARGS))
    args = dict(model=MODEL, instructions=INSTRUCTIONS, tools=[ORDER_TOOL], temperature=0, max_output_tokens=200)
    first = scripted_client.responses.create(input=script(reply), **args)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_order_details" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments) == ORDER_ARGS
    answer = f"Order {ORDER_ID} was delivered."
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": tool_result({"status": "delivered"}, answer)}
    second = scripted_client.responses.create(input=[result], previous_response_id=first.id, **args)
    assert second.status == "completed" and second.output_text == answer
    assert second.usage.input_tokens_details.cached_tokens > 0  # the tool group


def test_a_streamed_call_arrives_as_function_call_events(scripted):
    reply = hermes_calls(("get_order_details", ORDER_ARGS), ("get_order_details", {"order_id": "#W1"}))
    events = stream_events(scripted, {"model": MODEL, "input": script(reply), "tools": [ORDER_TOOL],
                                      "temperature": 0, "max_output_tokens": 200})
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" not in kinds
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [e["output_index"] for e in added] == [0, 1] and [e["output_index"] for e in done] == [0, 1]
    for index, (start, end) in enumerate(zip(added, done, strict=True)):
        item_id = start["item"]["id"]
        fragments = [e["delta"] for e in events
                     if e["type"] == "response.function_call_arguments.delta" and e["item_id"] == item_id]
        assert start["item"]["arguments"] == "" and start["item"]["status"] == "in_progress"
        assert end["item_id"] == item_id and "".join(fragments) == end["arguments"]
        assert events[-1]["response"]["output"][index]["arguments"] == end["arguments"]
    final = validated(events[-1]["response"])
    assert [json.loads(c.arguments) for c in final.output] == [ORDER_ARGS, {"order_id": "#W1"}]


def test_a_call_cut_by_max_output_tokens_is_an_incomplete_item_after_whole_ones(scripted, scripted_client):
    """The cut call's arguments are not JSON: it says `incomplete` (it said `completed`), whole or
    streamed; the call before it is whole and says so."""
    reply = hermes_calls(("get_order_details", ORDER_ARGS), ("get_order_details", {"order_id": "#W1"}))
    args = dict(model=MODEL, input=script(reply), tools=[ORDER_TOOL], temperature=0)
    whole = scripted_client.responses.create(max_output_tokens=200, **args)
    cut = scripted_client.responses.create(max_output_tokens=whole.usage.output_tokens - 6, **args)
    assert cut.status == "incomplete" and [c.status for c in cut.output] == ["completed", "incomplete"]
    assert json.loads(cut.output[0].arguments) == ORDER_ARGS
    events = stream_events(scripted, {**args, "max_output_tokens": whole.usage.output_tokens - 6})
    done = [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"]
    assert done == ["completed", "incomplete"] and events[-1]["type"] == "response.incomplete"
    assert [item["status"] for item in events[-1]["response"]["output"]] == done


def test_the_sdk_stream_helper_gives_the_final_response(scripted_client):
    with scripted_client.responses.stream(model=MODEL, input=script("All done."), temperature=0,
                                          max_output_tokens=50) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and final.output_text == "All done."


def test_the_openai_agents_default_model_runs_a_tool_loop(scripted):
    """openai-agents speaks the Responses API by default: it sends the whole run's items back each
    turn (its output items as input), whole and streamed."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    looked_up: list[str] = []

    @function_tool
    def get_order_details(order_id: str) -> str:
        """Get the details of an order."""
        looked_up.append(order_id)
        return "delivered " + script("Your order was delivered.")

    async def run() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=scripted.api_url, api_key="unused", max_retries=0)
        agent = Agent(name="retail", instructions=INSTRUCTIONS, tools=[get_order_details],
                      model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(temperature=0, max_tokens=200))
        question = script(hermes_calls(("get_order_details", ORDER_ARGS)))
        whole = await Runner.run(agent, question)
        streamed = Runner.run_streamed(agent, question)
        async for _ in streamed.stream_events():
            pass
        return whole.final_output, streamed.final_output

    assert asyncio.run(run()) == ("Your order was delivered.",) * 2
    assert looked_up == [ORDER_ID] * 2
