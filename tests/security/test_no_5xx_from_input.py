"""Input that once gave a 5xx, against a real server: a schema with no finite instance, a
`logit_bias` key too long to be a number, and valid schemas or fields toolkv's own checks
refused. Each is a 4xx in the OpenAI envelope naming the field, or accepted as OpenAI accepts it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
SELF = {"$ref": "#"}
REQUIRED_SELF = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}}}
NON_EMPTY_LIST = {"type": "array", "items": {"$ref": "#"}, "minItems": 1}
NO_FINITE_INSTANCE = {"self": SELF, "required-self": REQUIRED_SELF, "loop": LOOP, "non-empty-list": NON_EMPTY_LIST}


def post(live: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(live.api_url + path, json=body, timeout=120)


def rejected(resp: httpx.Response, param: str) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    return dict(error)


def tool(schema: Any, name: str = "walk") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": schema}}


@pytest.mark.parametrize("kind", list(NO_FINITE_INSTANCE))
def test_a_schema_with_no_finite_instance_is_a_400_at_request_time_never_a_500(live, kind):
    schema = NO_FINITE_INSTANCE[kind]
    fine = tool({"type": "object", "properties": {}}, "ping")
    for choice in ("auto", "required", {"type": "function", "function": {"name": "walk"}}):
        error = rejected(post(live, "/chat/completions", dict(HI, tools=[fine, tool(schema)], tool_choice=choice)),
                         "tools[1].function.parameters")
        # parameters are an object's schema: another type is refused as that, before any walk
        assert ("no finite value" if schema.get("type", "object") == "object" else "type 'object'") in error["message"]
    structured = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    rejected(post(live, "/chat/completions", dict(HI, response_format=structured)),
             "response_format.json_schema.schema")
    responses = {"input": "hi", "max_output_tokens": 16, "tools": [{"type": "function", "name": "walk",
                                                                      "parameters": schema}]}
    rejected(post(live, "/responses", responses), "tools[0].parameters")
    assert post(live, "/chat/completions", dict(HI, tools=[fine])).status_code == 200


def test_recursive_schemas_with_an_end_are_accepted(live):
    """A recursion that may stop (optional, nullable, or an empty list) is a tree, not a 400."""
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "v": {"enum": [1, 2]}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 1},
        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["v", "next"]}}}
    structured = {"type": "json_schema", "json_schema": {"name": "tree", "schema": tree}}
    resp = post(live, "/chat/completions", dict(HI, response_format=structured, max_tokens=2))
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("key", ["1" * 5000, "0" * 4999 + "1", "9" * 21])
def test_a_logit_bias_key_too_long_for_a_token_id_is_a_400(live, key):
    for path, body in (("/chat/completions", HI), ("/completions", {"prompt": "hi", "max_tokens": 2})):
        error = rejected(post(live, path, dict(body, logit_bias={key: 1})), "logit_bias")
        assert "digits" in error["message"]
    assert post(live, "/chat/completions", dict(HI, logit_bias={"0" * 19 + "1": 1})).status_code == 200


def test_chat_accepts_verbosity_medium_openai_default(live):
    client = openai.OpenAI(base_url=live.api_url, api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    answer = client.chat.completions.create(model=model, messages=HI["messages"], max_tokens=2, verbosity="medium")
    assert answer.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as refused:  # other values would change the answer: not served
        client.chat.completions.create(model=model, messages=HI["messages"], max_tokens=2, verbosity="low")
    assert refused.value.body["param"] == "verbosity"  # type: ignore[index]


def test_a_min_length_above_max_string_chars_is_served_not_refused(live):
    """toolkv bounds strings a schema leaves open (max_string_chars, 256 here), never below their
    minLength: the schema OpenAI accepts is served, and what comes back is valid for it."""
    schema = {"type": "object", "properties": {"code": {"type": "string", "minLength": 300}}, "required": ["code"]}
    structured = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    resp = post(live, "/chat/completions", dict(HI, response_format=structured, max_tokens=400))
    assert resp.status_code == 200, resp.text
    answer = resp.json()["choices"][0]
    assert answer["finish_reason"] == "stop"
    jsonschema.validate(json.loads(answer["message"]["content"]), schema)


def test_an_object_requiring_unlisted_keys_is_served_not_refused(live):
    """Closing objects (no keys beyond `properties`) must not leave a required key no place."""
    schema = {"type": "object", "properties": {"a": {"enum": [1]}}, "required": ["a", "b"]}
    answer = post(live, "/chat/completions", dict(HI, response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "schema": schema}}, max_tokens=2))
    assert answer.status_code == 200, answer.text


def _wide_answer(properties: int) -> dict[str, Any]:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}
    return {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}}


def test_an_answer_schema_past_the_grammar_limits_is_a_400_naming_it_even_mid_stream(live):
    """llguidance's parser meets its row limit only once the answer's object opens, after the
    response may have started: a 400 (or, streamed, an error event) naming response_format, not a
    500. Below the limit (600 optional properties failed before), the answer is served."""
    error = rejected(post(live, "/chat/completions", dict(HI, response_format=_wide_answer(3000))),
                     "response_format.json_schema.schema")
    assert "too large for constrained decoding" in error["message"]
    with httpx.stream("POST", live.api_url + "/chat/completions", timeout=120,
                      json=dict(HI, response_format=_wide_answer(3000), stream=True)) as resp:
        lines = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    assert json.loads(lines[-2])["error"]["type"] == "invalid_request_error"
    assert json.loads(lines[-2])["error"]["param"] == "response_format.json_schema.schema"
    served = post(live, "/chat/completions", dict(HI, response_format=_wide_answer(600)))
    assert served.status_code == 200, served.text
    wide = _wide_answer(3000)["json_schema"]["schema"]
    model = httpx.get(live.api_url + "/models", timeout=10).json()["data"][0]["id"]
    messages = post(live, "/messages", {"model": model, "max_tokens": 4, "temperature": 0,
                                        "messages": HI["messages"],
                                        "output_config": {"format": {"type": "json_schema", "schema": wide}}})
    assert messages.status_code == 400, messages.text
    assert messages.json()["error"]["type"] == "invalid_request_error"  # Anthropic's envelope
    assert "'output_config.format.schema' schema is too large" in messages.json()["error"]["message"]
    text_format = {"type": "json_schema", "name": "wide", "schema": wide}
    rejected(post(live, "/responses", {"model": model, "input": "hi", "max_output_tokens": 4, "temperature": 0,
                                       "text": {"format": text_format}}), "text.format")


def test_a_bad_regex_in_a_schema_is_a_400_that_says_what_is_wrong(live):
    """The grammar engine's error spans lines; only its first ("regex parse error:") reached the client."""
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "a(b"}}, "required": ["code"]}
    structured = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    error = rejected(post(live, "/chat/completions", dict(HI, response_format=structured)),
                     "response_format.json_schema.schema")  # as the finite-instance check names it
    assert "a(b" in error["message"] and "unclosed group" in error["message"]


def test_a_streamed_response_that_fails_on_the_schema_says_so_as_a_whole_one_does_and_is_kept(live):
    """Streamed, the error event had no code and no param, `response.failed` said `server_error`,
    and the failed response was not kept (GET: 404)."""
    model = httpx.get(live.api_url + "/models", timeout=10).json()["data"][0]["id"]
    text_format = {"type": "json_schema", "name": "wide", "schema": _wide_answer(3000)["json_schema"]["schema"]}
    body = {"model": model, "input": "hi", "max_output_tokens": 4, "temperature": 0, "text": {"format": text_format}}
    with httpx.stream("POST", live.api_url + "/responses", json={**body, "stream": True}, timeout=120) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    error, failed = events[-2], events[-1]
    assert (error["type"], error["param"], error["code"]) == ("error", "text.format", "invalid_request_error")
    assert failed["type"] == "response.failed" and failed["response"]["error"]["code"] == "invalid_prompt"
    kept = httpx.get(live.api_url + "/responses/" + failed["response"]["id"], timeout=10)
    assert kept.status_code == 200 and kept.json()["status"] == "failed"
