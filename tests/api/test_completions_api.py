"""Legacy text completions (`POST /v1/completions`) as the openai SDK sees them: `text_completion`
objects and chunks validated with the SDK's own types, OpenAI's default of 16 tokens, a repeated
prompt's KV reused (`cached_tokens`), stop sequences, token-id prompts, and errors in OpenAI's
envelope naming the field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai.types import Completion
from transformers import AutoTokenizer

from tests.support.waiting import wait_until

MODEL = "tiny-llama"
PROMPT = "The merchant's best-selling product last week was"
# Over two prefill chunks (128 tokens): a repeat reuses the chunks its record holds.
LONG_PROMPT = " ".join(f"Order {n} shipped to warehouse {n % 7} on day {n % 30}." for n in range(40))


def validated(body: dict[str, Any]) -> Completion:
    return Completion.model_validate(body, strict=True)


def stream_chunks(live, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", live.api_url + "/completions", json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    for chunk in chunks:
        validated(_finished(chunk))
    return chunks


def _finished(chunk: dict[str, Any]) -> dict[str, Any]:
    """The SDK types a stream chunk as a Completion, whose finish_reason is never null; OpenAI's
    chunks (and ours) carry null until the last one: check the rest of the shape strictly."""
    choices = [{**c, "finish_reason": c["finish_reason"] or "length"} for c in chunk["choices"]]
    return {**chunk, "choices": choices}


def test_completion_has_openai_shape_and_usage(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    validated(resp.model_dump(exclude_unset=True))
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-") and resp.model == MODEL
    [choice] = resp.choices
    assert choice.index == 0 and choice.logprobs is None and isinstance(choice.text, str)
    assert choice.finish_reason in ("stop", "length")
    usage = resp.usage
    assert (choice.finish_reason == "length") == (usage.completion_tokens == 5)
    assert usage.prompt_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert resp.system_fingerprint.startswith("fp_")


def test_max_tokens_defaults_to_16_as_openai(client):
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0)
    assert resp.usage.completion_tokens == 16 or resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens <= 16


def test_a_repeated_prompt_reuses_its_kv(client):
    first = client.completions.with_raw_response.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2,
                                                         temperature=0)
    second = client.completions.with_raw_response.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2,
                                                          temperature=0)
    cold, warm = first.parse(), second.parse()
    assert cold.usage.prompt_tokens == warm.usage.prompt_tokens > 256
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < warm.usage.prompt_tokens_details.cached_tokens < warm.usage.prompt_tokens
    assert warm.choices[0].text == cold.choices[0].text  # reused KV, same greedy tokens
    # no tool group is stored (the KV reused is the first prompt's record, which is not counted)
    assert [u.prompt_tokens_details.cache_write_tokens for u in (cold.usage, warm.usage)] == [0, 0]
    assert first.headers["x-toolkv-cache"] == "skip"  # no tool group: nothing to look up
    assert "prefill" in second.headers["server-timing"]


def test_bypass_computes_the_whole_prompt(client):
    client.completions.create(model=MODEL, prompt=LONG_PROMPT + " Again.", max_tokens=1, temperature=0)
    plain = client.completions.with_raw_response.create(
        model=MODEL, prompt=LONG_PROMPT + " Again.", max_tokens=1, temperature=0,
        extra_headers={"X-Toolkv-Cache": "bypass"})
    assert plain.headers["x-toolkv-cache"] == "bypass"
    assert plain.parse().usage.prompt_tokens_details.cached_tokens == 0


def test_stream_chunks_carry_the_same_text_and_end_with_usage(live, client):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "stream_options": {"include_usage": True}}
    chunks = stream_chunks(live, body)
    assert all(c["object"] == "text_completion" for c in chunks) and len({c["id"] for c in chunks}) == 1
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 8
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert streamed == whole.choices[0].text


def test_stream_without_include_usage_has_no_usage_chunk(live):
    chunks = stream_chunks(live, {"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
    assert all(c["choices"] and "usage" not in c for c in chunks)


def test_a_stop_sequence_ends_the_text_before_it(client):
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = free[len(free) // 2:][:3]
    assert stop.strip(), free  # a stop sequence from the middle of the free text
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and choice.text == free[: free.index(stop)]


def test_a_prompt_of_token_ids_equals_its_text(client, tokenizer_dir):
    ids = AutoTokenizer.from_pretrained(tokenizer_dir)(PROMPT)["input_ids"]
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    by_list = client.completions.create(model=MODEL, prompt=[PROMPT], max_tokens=6, temperature=0)
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text == by_list.choices[0].text


def test_a_seed_repeats_a_sampled_completion(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    assert client.completions.create(**args).choices[0].text == client.completions.create(**args).choices[0].text


def test_a_client_that_hangs_up_cancels_its_generation(live):
    engine = live.app.state.gateway.model.runtime.engine
    cancelled = engine.num_cancelled
    hangups = live.app.state.gateway.metrics.requests.labels(status="499", stream="false")
    before = hangups._value.get()
    # greedy: this model's greedy answer runs to max_tokens (~7 s here), where a sampled one may draw
    # its end token before the client hangs up (it did once in CI)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.api_url + "/completions", json={"model": MODEL, "prompt": "Count", "max_tokens": 3000,
                                                        "temperature": 0}, timeout=1.5)
    assert wait_until(lambda: (hangups._value.get(), engine.num_cancelled) == (before + 1, cancelled + 1)), \
        "the hang-up was not counted and cancelled"


@pytest.mark.parametrize("body, status, param, code", [
    ({"n": 2}, 400, "n", None),
    ({"best_of": 2}, 400, "best_of", "unsupported_parameter"),
    ({"suffix": "The end."}, 400, "suffix", "unsupported_parameter"),
    ({"echo": True}, 400, "echo", "unsupported_parameter"),
    ({"logprobs": 6}, 400, "logprobs", None),
    ({"presence_penalty": 2.5}, 400, "presence_penalty", None),
    ({"prompt": ["one", "two"]}, 400, "prompt", None),
    ({"prompt": []}, 400, "prompt", None),
    ({"prompt": ""}, 400, "prompt", None),
    ({"prompt": [10**9]}, 400, "prompt", None),
    ({"prompt": None}, 400, "prompt", None),
    ({"temperature": "hot"}, 400, "temperature", None),
    ({"max_tokens": 10**9}, 400, "max_tokens", "context_length_exceeded"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ({"prompt_cache_key": 42}, 400, "prompt_cache_key", None),
    ({"model": "gpt-9"}, 404, "model", "model_not_found"),
])
def test_bad_requests_get_openai_error_envelopes_naming_the_field(live, body, status, param, code):
    resp = httpx.post(live.api_url + "/completions", json={"model": MODEL, "prompt": "hi", **body}, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert code is None or error["code"] == code


def test_accepted_no_op_values(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=1, best_of=1, echo=False,
                                     suffix="", frequency_penalty=0, presence_penalty=0, logit_bias={}, user="u1",
                                     extra_body={"prompt_cache_key": "conversation-1"})
    assert resp.usage.completion_tokens <= 2
