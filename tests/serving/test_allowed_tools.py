"""`tool_choice: {"type": "allowed_tools", ...}` through the openai SDK, chat and Responses: every tool
in `tools` stays in the prompt (the tool group, and so its cached KV, is the same whatever the
subset), and the grammar holds calls to the allowed subset. The scripted model writes the call its
prompt asks for, so a call to a tool outside the subset is what the model would have written."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.support.family_models import script
from tests.support.server import LiveServer

SYSTEM = "You are the shop's retail agent. Use the tools."
ORDER, USER, CANCEL = "get_order_details", "get_user_details", "cancel_pending_order"
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ').capitalize()}.",
                                      "parameters": {"type": "object", "properties": {arg: {"type": "string"}},
                                                     "required": [arg]}}}
    for name, arg in ((ORDER, "order_id"), (USER, "user_id"), (CANCEL, "order_id"))
]
USER_CALL = f'<tool_call>\n{{"name": "{USER}", "arguments": {{"user_id": "yusuf_rossi_9620"}}}}\n</tool_call>'
FORCED_USER_CALL = USER_CALL.removeprefix("<tool_call>\n")  # what follows the opening `required` forces


def allowed(mode: str, *names: str) -> dict[str, Any]:
    return {"type": "allowed_tools",
            "allowed_tools": {"mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}


@pytest.fixture
def client(family_server: Any) -> openai.OpenAI:
    live: LiveServer = family_server("chatml", scripted=True)
    return openai.OpenAI(base_url=live.api_url, api_key="unused", max_retries=0)


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def ask(client: openai.OpenAI, reply: str, tool_choice: Any, **extra: Any) -> Any:
    return client.chat.completions.create(model="tiny-chatml", messages=messages(script(reply)), tools=TOOLS,
                                          tool_choice=tool_choice, temperature=0, max_tokens=60, **extra)


def names_called(message: Any) -> list[str]:
    return [call.function.name for call in message.tool_calls or ()]


def test_auto_holds_a_call_to_the_allowed_tools(client):
    """The model writes a call to get_user_details: with every tool allowed it comes back as
    written; with only get_order_details allowed, the grammar makes it a call to that one."""
    assert names_called(ask(client, USER_CALL, "auto").choices[0].message) == [USER]
    restricted = ask(client, USER_CALL, allowed("auto", ORDER)).choices[0].message
    assert names_called(restricted) == [ORDER]


def test_auto_still_lets_the_model_answer_in_text(client):
    choice = ask(client, "Your order is on its way.", allowed("auto", ORDER, CANCEL)).choices[0]
    assert choice.message.content == "Your order is on its way."
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"


def test_required_calls_one_of_the_allowed_tools_whole_and_streamed(client):
    """Text is not an answer under `required`, and the call the model leans to (get_user_details) is
    not allowed: what comes back is a call to one of the two allowed tools, streamed or not."""
    assert names_called(ask(client, FORCED_USER_CALL, "required").choices[0].message) == [USER]
    choice = allowed("required", ORDER, CANCEL)
    message = ask(client, FORCED_USER_CALL, choice).choices[0].message
    assert message.content is None and message.tool_calls
    assert set(names_called(message)) <= {ORDER, CANCEL}
    deltas = [c.choices[0].delta for c in ask(client, FORCED_USER_CALL, choice, stream=True) if c.choices]
    assert not any(d.content for d in deltas)
    streamed = [call.function.name for d in deltas for call in d.tool_calls or () if call.function.name]
    assert streamed == names_called(message)  # the same answer, at temperature 0


def test_required_with_one_allowed_tool_calls_it(client):
    message = ask(client, "Hello!", allowed("required", CANCEL), parallel_tool_calls=False).choices[0].message
    assert names_called(message) == [CANCEL]
    assert json.loads(message.tool_calls[0].function.arguments)["order_id"] is not None


def test_another_allowed_subset_hits_the_same_cached_tool_group(client):
    """Every tool is rendered whatever the subset: the prompt is the same and the group a request
    without `allowed_tools` cached is a hit for each subset."""
    def create(tool_choice: Any) -> Any:
        return client.chat.completions.with_raw_response.create(
            model="tiny-chatml", messages=messages("Warm up."), tools=TOOLS, tool_choice=tool_choice, temperature=0,
            max_tokens=4)

    first = create("auto")
    assert first.headers["x-toolkv-cache"] in ("miss", "hit")  # hit when an earlier test cached it
    usages = []
    for subset in ((ORDER,), (USER, CANCEL)):
        raw = create(allowed("auto", *subset))
        assert raw.headers["x-toolkv-cache"] == "hit"
        usages.append(raw.parse().usage)
    assert usages[0].prompt_tokens == usages[1].prompt_tokens == first.parse().usage.prompt_tokens
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    assert cached[0] == cached[1] > 0


def test_an_allowed_tool_not_in_tools_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as raised:
        ask(client, "Hi", allowed("auto", ORDER, "refund_order"))
    assert raised.value.param == "tool_choice.allowed_tools.tools[1].function.name"
    assert "refund_order" in raised.value.message


# ---- Responses ----------------------------------------------------------------------------------

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def respond(client: openai.OpenAI, reply: str, tool_choice: Any) -> Any:
    return client.responses.create(model="tiny-chatml", instructions=SYSTEM, input=script(reply), tools=FLAT_TOOLS,
                                   tool_choice=tool_choice, temperature=0, max_output_tokens=60)


def test_responses_allowed_tools_holds_the_call_and_is_echoed(client):
    choice = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": ORDER}]}
    response = respond(client, USER_CALL, choice)
    assert [item.name for item in response.output if item.type == "function_call"] == [ORDER]
    assert response.tool_choice.model_dump() == choice
    assert response.usage.input_tokens_details.cached_tokens > 0  # the group chat cached: the same


@pytest.mark.parametrize("tools, param", [
    ([{"type": "function", "name": ORDER}, {"type": "function", "name": "refund_order"}], "tool_choice.tools[1].name"),
    ([{"type": "file_search"}], "tool_choice.tools[0].type"),
    ([], "tool_choice.tools"),
])
def test_responses_allowed_tools_that_cannot_be_honoured_are_a_400_naming_them(client, tools, param):
    with pytest.raises(openai.BadRequestError) as raised:
        respond(client, "Hi", {"type": "allowed_tools", "mode": "required", "tools": tools})
    assert raised.value.param == param
