"""Forced calls (a named function, or `required`) are valid for their tool's schema whatever the
schema is rooted at: `{}` is forced whole only for a schema that takes no arguments, and everything
after a forced call is under the grammar too. Random weights write noise, so whatever comes back
valid was made valid by the grammar (values are bounded, so that noise ends within max_tokens)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from tests.serving.wire import assemble, post, stream
from tests.support.family_models import SETUPS

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"]}
ROOTED = {
    "ref": {"$ref": "#/$defs/args", "$defs": {"args": CITY}},
    "allOf": {"allOf": [CITY, {"type": "object"}]},
    "anyOf": {"anyOf": [CITY]},
    "oneOf": {"oneOf": [CITY, {"type": "object", "properties": {"day": {"enum": [1, 2]}}, "required": ["day"]}]},
}
# `{}` is invalid for these too, but their values are open: noise may run past max_tokens
OPEN = {"required-without-properties": {"type": "object", "required": ["city"]},
        "minProperties": {"type": "object", "minProperties": 1}}
PING = {"type": "function", "function": {"name": "ping", "description": "Check the service.",
                                         "parameters": {"type": "object", "properties": {}}}}


def weather(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "weather", "description": "The weather.", "parameters": schema}}


def ask(tools: list[dict[str, Any]], choice: Any, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "What is the weather?"}], "tools": tools,
            "tool_choice": choice, "temperature": 0, "max_tokens": 120, **extra}


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("rooted", list(ROOTED))
def test_a_forced_call_is_valid_for_its_schema_whatever_the_schema_is_rooted_at(family_server, setup, rooted):
    schema = ROOTED[rooted]
    live = family_server(setup)
    for choice in (named("weather"), "required"):
        request = ask([weather(schema)], choice, parallel_tool_calls=False)
        answer = post(live, request)["choices"][0]
        [call] = answer["message"]["tool_calls"]
        assert call["function"]["name"] == "weather" and answer["finish_reason"] == "tool_calls"
        arguments = json.loads(call["function"]["arguments"])
        assert arguments != {}
        jsonschema.validate(arguments, schema)
        content, calls, finish = assemble(stream(live, request))
        assert (content, finish) == (None, "tool_calls")
        assert [c["function"] for c in calls] == [call["function"]]


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("kind", list(OPEN))
def test_a_forced_call_never_gets_empty_arguments_its_schema_refuses(family_server, setup, kind):
    """What the model wrote, under the grammar: valid when it ended, a cut-off object otherwise."""
    answer = post(family_server(setup), ask([weather(OPEN[kind])], named("weather")))["choices"][0]
    [call] = answer["message"]["tool_calls"]
    assert call["function"]["arguments"].startswith('{"')
    if answer["finish_reason"] == "tool_calls":
        jsonschema.validate(json.loads(call["function"]["arguments"]), OPEN[kind])


@pytest.mark.parametrize("setup", list(SETUPS))
def test_nothing_follows_a_whole_forced_call_when_parallel_calls_are_allowed(family_server, setup):
    """Named and taking no arguments, the call is forced whole; parallel_tool_calls (true by default)
    does not free what follows it: the grammar allows only the end, not text nor another call."""
    live = family_server(setup)
    for request in (ask([PING, weather(CITY)], named("ping")), ask([PING], "required", parallel_tool_calls=True)):
        resp = post(live, request)
        answer = resp["choices"][0]
        assert answer["message"]["content"] is None
        assert [c["function"] for c in answer["message"]["tool_calls"]] == [{"name": "ping", "arguments": "{}"}]
        assert answer["finish_reason"] == "tool_calls"
        assert resp["usage"]["completion_tokens"] <= 1  # the end of the output, at most
