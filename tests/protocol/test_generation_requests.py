"""Each API's request as the GenerationRequest the service takes (gateway/protocol/generation.py):
the same conversation whichever API carried it, and the field names its errors use, the client's
own from the start (no error is renamed afterwards)."""

from __future__ import annotations

import pytest

from adapters.base import ChatMessage, ToolCallIn, ToolSpec
from gateway.errors import BadRequest
from gateway.protocol import messages
from gateway.protocol.chat import ChatCompletionRequest
from gateway.protocol.generation import ToolChoice
from gateway.protocol.messages import MessagesRequest
from gateway.serving.output_grammar import check_tool_choice, check_unique_names

pytestmark = pytest.mark.model_free

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}}}
CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Order 7?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "get", "arguments": {"id": 7}}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "shipped"}, {"role": "user", "content": "Ok"}],
        "tools": [{"type": "function", "function": {"name": "get", "parameters": SCHEMA}}],
        "tool_choice": {"type": "function", "function": {"name": "get"}}, "parallel_tool_calls": False,
        "max_tokens": 9, "stop": ["END"]}
MESSAGES = {"system": "Be brief.", "max_tokens": 9, "stop_sequences": ["END"],
            "messages": [{"role": "user", "content": "Order 7?"},
                         {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "get",
                                                            "input": {"id": 7}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                                       "content": "shipped"}, {"type": "text", "text": "Ok"}]}],
            "tools": [{"name": "get", "input_schema": SCHEMA}],
            "tool_choice": {"type": "tool", "name": "get", "disable_parallel_tool_use": True}}


def test_a_messages_request_is_the_generation_its_chat_twin_asks_for():
    chat = ChatCompletionRequest.model_validate(CHAT).to_generation()
    anthropic = messages.to_generation(MessagesRequest.model_validate(MESSAGES))
    assert anthropic.messages == chat.messages == (
        ChatMessage("system", "Be brief."), ChatMessage("user", "Order 7?"),
        ChatMessage("assistant", None, (ToolCallIn("c1", "get", '{"id": 7}'),)),
        ChatMessage("tool", "shipped", tool_call_id="c1"), ChatMessage("user", "Ok"))
    assert anthropic.tools == chat.tools == (ToolSpec("get", None, SCHEMA),)
    assert anthropic.tool_choice == chat.tool_choice == ToolChoice("required", named="get")
    assert (anthropic.parallel_tool_calls, anthropic.max_tokens, anthropic.sampling.stop) == (False, 9, ("END",))


@pytest.mark.parametrize(("body", "param"), [
    ({**CHAT, "tools": CHAT["tools"] * 2, "tool_choice": "auto"}, "tools[1].function.name"),
    ({**MESSAGES, "tools": MESSAGES["tools"] * 2, "tool_choice": {"type": "auto"}}, "tools[1].name"),
])
def test_a_repeated_tool_name_is_named_where_the_client_wrote_it(body, param):
    request = (messages.to_generation(MessagesRequest.model_validate(body)) if "system" in body
               else ChatCompletionRequest.model_validate(body).to_generation())
    with pytest.raises(BadRequest) as caught:
        check_unique_names(list(request.tools), request.fields)
    assert caught.value.param == param and param in caught.value.message


def test_a_tool_choice_naming_no_tool_names_the_clients_field():
    body = {**MESSAGES, "tool_choice": {"type": "tool", "name": "nope"}}
    with pytest.raises(BadRequest) as caught:
        check_tool_choice(messages.to_generation(MessagesRequest.model_validate(body)))
    assert (caught.value.param, caught.value.message) == (
        "tool_choice", "tool_choice names the function 'nope', which is not in 'tools'")


def test_a_legacy_functions_request_names_its_functions():
    body = {"messages": CHAT["messages"][:2], "functions": [{"name": "get"}, {"name": "put"}],
            "function_call": {"name": "get"}}
    names = ChatCompletionRequest.model_validate(body).to_generation().fields
    assert (names.tool_parameters.format(1), names.tool_choice, names.tool_word) == (
        "functions[1].parameters", "function_call", "function")
