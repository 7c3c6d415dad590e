"""Property-based fuzzing of the API: whatever arrives, the answer is never a 5xx, and every
error is in OpenAI's envelope. Runs against a real server with a tiny model whose context is
short, so generated requests stay fast."""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.settings import load_settings
from tests.support.server import serve

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir, tmp_path_factory):
    settings_ = load_settings(overrides={"model": str(tiny_model_dir("llama", context=256)), "min_prefix_tokens": 8,
                                         "cache_dir": str(tmp_path_factory.mktemp("cache")),
                                         "default_max_tokens": 8}, environ={})
    with serve(settings_) as live:
        yield live


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.base_url + "/openapi.json")


def assert_enveloped(status: int, body: bytes) -> None:
    assert status < 500, body[:500]
    if status >= 400:
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@FUZZ
def test_schemathesis_finds_no_server_error(case):
    response = case.call()
    assert_enveloped(response.status_code, response.content)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "x"]),
                                 "content": st.one_of(st.text(max_size=40), st.none(), json_values)})
near_valid = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=4)},
    optional={"max_tokens": st.integers(-5, 10**6) | json_values, "temperature": st.floats(-1, 5) | json_values,
              "top_p": st.floats(-1, 2), "n": st.integers(-1, 3), "stream": st.booleans(),
              "stop": st.text(max_size=5) | st.lists(st.text(max_size=3), max_size=6),
              "tools": st.lists(json_values, max_size=3), "tool_choice": json_values, "seed": json_values})


@given(body=near_valid)
@FUZZ
def test_near_valid_requests_never_5xx(fuzz_server, body):
    if body.get("stream") is True:
        body["max_tokens"] = 4 if not isinstance(body.get("max_tokens"), int) else body["max_tokens"]
    resp = httpx.post(fuzz_server.api_url + "/chat/completions", json=body, timeout=120)
    assert_enveloped(resp.status_code, resp.content)


@given(raw=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
@FUZZ
def test_arbitrary_bodies_never_5xx(fuzz_server, raw):
    resp = httpx.post(fuzz_server.api_url + "/chat/completions", content=raw, timeout=60,
                      headers={"content-type": "application/json"})
    assert_enveloped(resp.status_code, resp.content)


def _nest(depth: int, kind: str) -> str:
    """JSON text nested `depth` deep, built as text (json.dumps itself would recurse)."""
    opener, closer = ("[", "]") if kind == "list" else ('{"a":', "}")
    return opener * depth + "1" + closer * depth


numeric_strings = st.sampled_from(["5", "1e30", "100000000000000000000000", "-1", "0x10", "NaN", " 7 ", "true"])
deep = st.tuples(st.integers(20, 3000), st.sampled_from(["list", "dict"])).map(lambda t: _nest(*t))
deep_spot = st.sampled_from([
    '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
    '{"name": "f", "parameters": %s}}]}',
    '{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", '
    '"function": {"name": "f", "arguments": %s}}]}, {"role": "user", "content": "hi"}]}',
    '{"messages": [{"role": "user", "content": "hi"}], "metadata": %s}',
    '{"messages": [{"role": "user", "content": %s}]}',
])


@given(template=deep_spot, nested=deep, as_text=st.booleans())
@FUZZ
def test_deep_nesting_anywhere_never_5xx(fuzz_server, template, nested, as_text):
    value = json.dumps(nested) if as_text else nested  # as a JSON string (arguments text) or as JSON
    resp = httpx.post(fuzz_server.api_url + "/chat/completions", content=(template % value).encode(),
                      headers={"content-type": "application/json"}, timeout=60)
    assert_enveloped(resp.status_code, resp.content)


@given(field=st.sampled_from(["max_tokens", "max_completion_tokens", "seed", "temperature", "top_p", "n",
                              "stream", "parallel_tool_calls"]),
       value=numeric_strings | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False))
@FUZZ
def test_numeric_strings_and_huge_numbers_are_4xx_or_served(fuzz_server, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    resp = httpx.post(fuzz_server.api_url + "/chat/completions", json=body, timeout=60)
    assert_enveloped(resp.status_code, resp.content)
    if isinstance(value, str):
        assert resp.status_code == 400 and resp.json()["error"]["param"] == field
