"""OpenAI's sampling fields as a client sees them: `logprobs` / `top_logprobs` (whole and streamed,
validated against OpenAI's strict schemas), `logit_bias`, `presence_penalty` / `frequency_penalty`,
the legacy `functions` / `function_call` (a bad function schema named as `functions[i]`), legacy
completions' `logprobs`, and a 400 naming the field for every bad value. The tiny random-weight
model's logits are nearly flat (a spread of ~0.7), so a bias of a few units decides the greedy
token and the penalties' arithmetic shows in the output."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from jsonschema import Draft202012Validator
from openai.types import Completion
from transformers import AutoTokenizer

from tests.conftest import STRICT_SPEC

MODEL = "tiny-llama"
HELLO = [{"role": "user", "content": "Say hello"}]
THE = 260  # " the" in the SmolLM2 vocabulary
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                          "required": ["city"]}}
CLOCK = {"name": "get_time", "description": "The time in a city",
         "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                        "required": ["zone"]}}


@pytest.fixture(scope="module")
def strict() -> Callable[[str, Any], None]:
    """validate(def_name, instance) against OpenAI's strict schemas (logprobs and refusal required)."""
    bundle = json.loads(STRICT_SPEC.read_text())

    def validate(name: str, instance: Any) -> None:
        schema = {"$schema": bundle["$schema"], "$defs": bundle["$defs"], "$ref": f"#/$defs/{name}"}
        Draft202012Validator(schema).validate(instance)

    return validate


@pytest.fixture(scope="module")
def token_ids(tokenizer_dir: Path) -> Callable[[str], list[int]]:
    """The ids whose whole text is `text`."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return lambda text: [i for i, t in enumerate(texts) if t == text]


def chat(live, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(live.api_url + "/chat/completions", json={"model": MODEL, **body}, timeout=60)


def stream(live, body: dict[str, Any], strict: Callable[[str, Any], None]) -> list[dict[str, Any]]:
    with httpx.stream("POST", live.api_url + "/chat/completions", json={"model": MODEL, **body, "stream": True},
                      timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    for chunk in chunks:
        strict("CreateChatCompletionStreamResponse", chunk)
    return chunks


def spelled(entries: list[dict[str, Any]]) -> str:
    return b"".join(bytes(e["bytes"]) for e in entries).decode()


def greedy(**extra: Any) -> dict[str, Any]:
    return {"messages": HELLO, "temperature": 0, "max_tokens": 10, **extra}


# ---- logprobs -----------------------------------------------------------------------------------


def test_logprobs_have_openai_shape_spell_the_content_and_greedy_picks_the_top(live, strict):
    resp = chat(live, greedy(logprobs=True, top_logprobs=3))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    strict("CreateChatCompletionResponse", body)
    choice = body["choices"][0]
    entries = choice["logprobs"]["content"]
    assert choice["logprobs"]["refusal"] is None
    assert len(entries) == body["usage"]["completion_tokens"] == 10
    assert spelled(entries) == "".join(e["token"] for e in entries) == choice["message"]["content"]
    for entry in entries:
        top = entry["top_logprobs"]
        assert len(top) == 3 and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert entry["logprob"] == max(t["logprob"] for t in top) < 0  # greedy: the most likely token
        assert top[0]["token"] == entry["token"] and top[0]["bytes"] == entry["bytes"]


def test_logprobs_without_top_logprobs_have_empty_alternatives_and_off_means_null(live):
    on = chat(live, greedy(logprobs=True, max_tokens=3)).json()["choices"][0]
    assert [e["top_logprobs"] for e in on["logprobs"]["content"]] == [[], [], []]
    off = chat(live, greedy(max_tokens=3)).json()["choices"][0]
    assert off["logprobs"] is None and off["message"]["content"] == on["message"]["content"]


def test_each_stream_chunk_carries_the_logprobs_of_its_own_text(live, strict):
    whole = chat(live, greedy(logprobs=True, top_logprobs=2)).json()["choices"][0]
    chunks = stream(live, greedy(logprobs=True, top_logprobs=2), strict)
    streamed: list[dict[str, Any]] = []
    for chunk in chunks:
        [choice] = chunk["choices"]
        text = choice["delta"].get("content") or ""
        carried = choice["logprobs"]["content"] if choice["logprobs"] else []
        assert spelled(carried) == text  # no holdback here: a chunk's tokens are exactly its text
        streamed += carried
    assert streamed == whole["logprobs"]["content"]


def test_with_a_stop_sequence_logprobs_follow_the_text_sent(live, strict):
    """Text that may start a stop sequence is held back; a token's logprobs go out with the chunk
    that sends the end of its text, and a token that wrote only the stop sequence is not sent."""
    tokens = [e["token"] for e in chat(live, greedy(logprobs=True)).json()["choices"][0]["logprobs"]["content"]]
    stop = tokens[2]
    assert stop not in "".join(tokens[:2]) and len(stop) > 1
    whole = chat(live, greedy(logprobs=True, stop=stop)).json()["choices"][0]
    assert whole["message"]["content"] == "".join(tokens[:2]) == spelled(whole["logprobs"]["content"])
    sent, carried = "", []
    for chunk in stream(live, greedy(logprobs=True, stop=stop), strict):
        [choice] = chunk["choices"]
        sent += choice["delta"].get("content") or ""
        carried += choice["logprobs"]["content"] if choice["logprobs"] else []
        assert sent.startswith(spelled(carried))  # never ahead of the text
    assert spelled(carried) == sent == whole["message"]["content"]


def test_an_empty_stop_string_stops_nothing_in_chat_as_in_completions(live):
    """`stop: ""` matches everywhere; OpenAI treats it as no stop. Chat once stopped at once, with
    an empty answer, where completions (which drop empty stops) wrote the whole answer."""
    plain = chat(live, greedy()).json()["choices"][0]["message"]["content"]
    assert plain
    for stop in ("", [""], ["", "\u0000never"]):
        assert chat(live, greedy(stop=stop)).json()["choices"][0]["message"]["content"] == plain


def test_the_sdk_reads_logprobs_whole_and_streamed(client):
    resp = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=4, logprobs=True,
                                          top_logprobs=1)
    tokens = resp.choices[0].logprobs.content
    assert "".join(t.token for t in tokens) == resp.choices[0].message.content
    parts = [c.choices[0].logprobs for c in client.chat.completions.create(
        model=MODEL, messages=HELLO, temperature=0, max_tokens=4, logprobs=True, top_logprobs=1, stream=True)
        if c.choices and c.choices[0].logprobs]
    assert [t.logprob for p in parts for t in p.content] == [t.logprob for t in tokens]


# ---- logit_bias and penalties -------------------------------------------------------------------


def test_a_bias_of_100_makes_the_greedy_answer_that_token(live):
    body = chat(live, greedy(logit_bias={str(THE): 100}, max_tokens=6, logprobs=True)).json()
    assert body["choices"][0]["message"]["content"] == " the" * 6
    assert all(e["logprob"] > -1e-3 for e in body["choices"][0]["logprobs"]["content"])  # ~certain


def test_a_bias_of_minus_100_on_the_greedy_token_changes_the_first_token(live, token_ids):
    first = chat(live, greedy(logprobs=True)).json()["choices"][0]["logprobs"]["content"][0]["token"]
    banned = token_ids(first)
    assert banned
    again = chat(live, greedy(logprobs=True, logit_bias={str(i): -100 for i in banned})).json()
    assert again["choices"][0]["logprobs"]["content"][0]["token"] != first


def test_presence_and_frequency_penalties_follow_openais_formula(live):
    """+3.5 on " the" makes it the greedy token by ~2.8. A presence penalty is paid once (2 < 2.8:
    it still repeats); a frequency penalty grows with the count (2 per use: it appears twice); both
    together stop it after one."""
    def answer(**penalties: Any) -> str:
        body = chat(live, greedy(logit_bias={str(THE): 3.5}, max_tokens=8, **penalties))
        assert body.status_code == 200, body.text
        return str(body.json()["choices"][0]["message"]["content"])

    assert answer() == answer(presence_penalty=2) == " the" * 8
    twice = answer(frequency_penalty=2)
    assert twice.startswith(" the the") and twice.count(" the") == 2
    once = answer(frequency_penalty=2, presence_penalty=2)
    assert once.startswith(" the") and once.count(" the") == 1


# ---- legacy functions ---------------------------------------------------------------------------


def test_a_named_function_call_answers_with_message_function_call(live, strict):
    resp = chat(live, {"messages": [{"role": "user", "content": "Weather in Paris?"}], "functions": [WEATHER, CLOCK],
                       "function_call": {"name": "get_weather"}, "temperature": 0, "max_tokens": 40})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    strict("CreateChatCompletionResponse", body)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "function_call"
    assert "tool_calls" not in choice["message"] and choice["message"]["content"] is None
    call = choice["message"]["function_call"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] in ("Paris", "Oslo")


def test_a_streamed_function_call_sends_the_name_then_argument_fragments(live, strict):
    body = {"messages": [{"role": "user", "content": "Time in Oslo?"}], "functions": [WEATHER, CLOCK],
            "function_call": {"name": "get_time"}, "temperature": 0, "max_tokens": 40}
    whole = chat(live, body).json()["choices"][0]["message"]["function_call"]
    chunks = stream(live, body, strict)
    calls = [c["choices"][0]["delta"]["function_call"] for c in chunks if "function_call" in c["choices"][0]["delta"]]
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)
    assert calls[0] == {"name": "get_time", "arguments": ""}
    assert all(set(c) == {"arguments"} for c in calls[1:]) and len(calls) > 1
    assert "".join(c["arguments"] for c in calls) == whole["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "function_call"


def test_the_sdk_reads_a_legacy_function_call_and_function_none_answers_in_text(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                          functions=[WEATHER], function_call={"name": "get_weather"},
                                          temperature=0, max_tokens=40)
    assert resp.choices[0].message.function_call.name == "get_weather"
    assert resp.choices[0].message.tool_calls is None
    none = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                          functions=[WEATHER], function_call="none", temperature=0, max_tokens=5)
    assert none.choices[0].message.function_call is None and none.choices[0].finish_reason in ("stop", "length")


def test_a_legacy_conversation_with_a_function_result_is_accepted(live):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None,
                 "function_call": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                {"role": "function", "name": "get_weather", "content": "{\"sky\": \"clear\"}"}]
    resp = chat(live, {"messages": messages, "functions": [WEATHER], "function_call": "none", "max_tokens": 3})
    assert resp.status_code == 200, resp.text


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"inner": schema}}
    return schema


BAD_TYPE = {"type": "object", "properties": {"city": {"type": "bogus"}}}
BAD_PATTERN = {"type": "object", "properties": {"city": {"type": "string", "pattern": "(("}}}


@pytest.mark.parametrize("functions, function_call, param, words", [
    ([{"name": "get_weather", "parameters": BAD_TYPE}], {"name": "get_weather"}, "functions[0].parameters",
     "constrained decoding"),
    ([CLOCK, {"name": "get_weather", "parameters": BAD_PATTERN}], "auto", "functions[1].parameters",
     "constrained decoding"),
    ([CLOCK, {"name": "deep", "parameters": nested(15)}], None, "functions[1].parameters",
     "the parameters schema of function 'deep' nests deeper"),
    ([{"name": "big", "description": "x" * 70_000}], None, "functions[0]", "function 'big' is"),
])
def test_a_bad_function_schema_is_named_as_the_function_it_was_sent_as(live, strict, functions, function_call,
                                                                        param, words):
    body = {"messages": HELLO, "max_tokens": 2, "functions": functions}
    if function_call is not None:
        body["function_call"] = function_call
    resp = chat(live, body)
    assert resp.status_code == 400, resp.text
    strict("ErrorResponse", resp.json())
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert "tool" not in error["message"]  # the request sent functions, not tools
    as_tools = chat(live, {"messages": HELLO, "max_tokens": 2,
                           "tools": [{"type": "function", "function": f} for f in functions]}).json()["error"]
    assert as_tools["param"] == param.replace("functions", "tools").replace("].", "].function.")


# ---- legacy completions -------------------------------------------------------------------------


def test_completions_logprobs_have_the_legacy_shape(live):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    whole = httpx.post(live.api_url + "/completions", json=body, timeout=60).json()
    Completion.model_validate(whole, strict=True)
    choice = whole["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"] and len(logprobs["tokens"]) == 6
    offsets = [0]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                                   strict=True):
        assert len(top) == 2 and top[token] == logprob == max(top.values())  # greedy: the chosen is the top
    with httpx.stream("POST", live.api_url + "/completions", json={**body, "stream": True}, timeout=60) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    assert [t for p in streamed for t in p["tokens"]] == logprobs["tokens"]
    assert [o for p in streamed for o in p["text_offset"]] == logprobs["text_offset"]


def test_a_special_token_the_text_leaves_out_reads_the_same_in_its_alternatives(live):
    """`<|im_start|>` (id 1, pushed by logit_bias) writes nothing into the answer: its entry is ""
    with no bytes, and so is its place among the alternatives; the legacy shape holds it once."""
    chat_entries = chat(live, greedy(logprobs=True, top_logprobs=2, logit_bias={"1": 100}, max_tokens=2)).json()
    for entry in chat_entries["choices"][0]["logprobs"]["content"]:
        assert (entry["token"], entry["bytes"]) == ("", [])
        assert (entry["top_logprobs"][0]["token"], entry["top_logprobs"][0]["bytes"]) == ("", [])
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0, "logprobs": 2,
            "logit_bias": {"1": 100}}
    legacy = httpx.post(live.api_url + "/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    for token, logprob, top in zip(legacy["tokens"], legacy["token_logprobs"], legacy["top_logprobs"], strict=True):
        assert token == "" and len(top) == 2 and top[token] == logprob


# ---- bad values ---------------------------------------------------------------------------------


@pytest.mark.parametrize("body, param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"presence_penalty": "1"}, "presence_penalty"),
    ({"logit_bias": {"the": 5}}, "logit_bias"),
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"logit_bias": {"260": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"260": "5"}}, "logit_bias[260]"),
    ({"functions": [WEATHER], "tools": [{"type": "function", "function": CLOCK}]}, "functions"),
    ({"functions": []}, "functions"),
    ({"functions": [WEATHER, WEATHER]}, "functions"),
    ({"functions": [WEATHER], "function_call": {"name": "get_time"}}, "function_call"),
    ({"function_call": {"name": "get_time"}}, "function_call"),
    ({"functions": [WEATHER], "function_call": "auto", "tool_choice": "none"}, "function_call"),
])
def test_bad_values_are_a_400_naming_the_field(live, body, param):
    resp = chat(live, {"messages": HELLO, "max_tokens": 2, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_the_sdk_raises_for_top_logprobs_without_logprobs(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HELLO, top_logprobs=2, max_tokens=2)
    assert info.value.body["param"] == "top_logprobs" and "logprobs" in info.value.body["message"]


@pytest.mark.parametrize("body, param", [
    ({"logprobs": 6}, "logprobs"), ({"logprobs": True}, "logprobs"), ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
])
def test_bad_completions_values_are_a_400_naming_the_field(live, body, param):
    resp = httpx.post(live.api_url + "/completions", json={"model": MODEL, "prompt": "hi", **body}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
