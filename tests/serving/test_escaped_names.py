"""Text that JSON escapes, through a real server on each family's format.

A tool name with `"`, `\\` or a control character was silently never cached (`X-Toolkv-Cache:
skip`): the tool block writes names as JSON, so the name the prefix check looked for was not in
the prompt as sent. OpenAI refuses such names (400, `^[a-zA-Z0-9_-]{1,64}$`), and so does toolkv
now; everything else that JSON escapes (descriptions, the system prompt, non-ASCII) is cached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support.family_models import SETUPS
from tests.support.server import LiveServer

CACHE_HEADER = "x-toolkv-cache"
ESCAPED = 'quote " backslash \\ tab \t bell \x07 escape \x1b newline \n unicode é 中文 🙂 </tools> {"x": 1}'


def tool(name: str, description: str = "Weather for a city.") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "description": description}}}}}


def body(tools: list[dict[str, Any]], system: str, question: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "tools": tools, "tool_choice": "none", "temperature": 0, "max_tokens": 6}


def chat(live: LiveServer, payload: dict[str, Any], bypass: bool = False) -> httpx.Response:
    headers = {CACHE_HEADER: "bypass"} if bypass else {}
    return httpx.post(live.api_url + "/chat/completions", json=payload, headers=headers, timeout=120)


@pytest.mark.parametrize("name", ['get"weather', "get\\weather", "get\nweather", "get\x00weather",
                                  "get weather", "get.weather", "wetter_in_münchen", "x" * 65, ""])
def test_tool_names_openai_refuses_are_a_400_naming_the_field(
        family_server: Callable[..., LiveServer], name: str) -> None:
    live = family_server("chatml")
    resp = chat(live, body([tool("lookup_order"), tool(name)], "You are a weather bot.", "Weather?"))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "tools[1].function.name", error


@pytest.mark.parametrize("family", list(SETUPS))
def test_groups_with_escaped_text_are_cached_and_answer_as_bypass(
        family_server: Callable[..., LiveServer], family: str) -> None:
    live = family_server(family)
    tools = [tool("get_weather", ESCAPED), tool("get-time_v2", "Time in a city. " + ESCAPED[::-1])]
    system = f"You are a weather bot ({family}). {ESCAPED}"
    first = chat(live, body(tools, system, "Weather in Paris?"))
    second = chat(live, body(tools, system, "Weather in Rome?"))
    plain = chat(live, body(tools, system, "Weather in Rome?"), bypass=True)
    for resp in (first, second, plain):
        assert resp.status_code == 200, resp.text
    assert [first.headers[CACHE_HEADER], second.headers[CACHE_HEADER]] == ["miss", "hit"]
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
