"""No work before the cheap checks, and no timing shared between tenants (issue 25, item 4), on a
real server with two API keys:

- every field that grows the prompt counts toward the character bound checked before rendering
  and tokenizing: tool-call arguments (3.5 MB of them took 4.7 s of tokenizing before a 400, and
  stalled other keys meanwhile) and tool schemas, not only message texts. Observed through a
  wrapper around the service's own tokenizer that counts its calls: a refused request never
  reaches it.
- the grammar cache is per tenant: key B's first use of a schema key A already used compiles
  B's own grammar (a miss), so `Server-Timing: prepare` cannot tell B what A sent."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.edge.admission import tenant_salt
from gateway.settings import load_settings
from tests.support.server import LiveServer, serve

KEY_A, KEY_B = "key-alpha-cheap-1", "key-beta-cheap-2"
SALT_A, SALT_B = tenant_salt(KEY_A.encode()), tenant_salt(KEY_B.encode())
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def keyed(tiny_model_dir, tmp_path_factory) -> Iterator[LiveServer]:
    settings = load_settings(overrides={
        "model": str(tiny_model_dir("llama")), "served_model_name": MODEL, "min_prefix_tokens": 8,
        "api_keys": (KEY_A, KEY_B), "cache_dir": str(tmp_path_factory.mktemp("cache"))}, environ={})
    with serve(settings) as live:
        yield live


class CountingTokenizer:
    """The service's tokenizer, counting the times it is asked to tokenize."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.calls += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def counting(keyed) -> Iterator[CountingTokenizer]:
    service = keyed.app.state.gateway.model.runtime.service
    real = service.prompt_tokens.tokenizer
    wrapper = CountingTokenizer(real)
    service.prompt_tokens.tokenizer = service.tokenizer = wrapper
    try:
        yield wrapper
    finally:
        service.prompt_tokens.tokenizer = service.tokenizer = real


def chat(live: LiveServer, key: str, **body: Any) -> httpx.Response:
    return httpx.post(live.api_url + "/chat/completions", timeout=120, headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "max_tokens": 1, "temperature": 0, **body})


def test_multi_megabyte_tool_call_arguments_are_refused_before_tokenizing(keyed, counting):
    arguments = json.dumps({"query": "a" * 3_500_000})
    resp = chat(keyed, KEY_A, messages=[
        {"role": "user", "content": "Find it."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "nothing"},
        {"role": "user", "content": "Thanks."}])
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "context_length_exceeded"
    assert counting.calls == 0
    fine = chat(keyed, KEY_A, messages=[{"role": "user", "content": "Hi."}])  # the wrapper is on the path
    assert fine.status_code == 200, fine.text
    assert counting.calls >= 1


def test_tool_schemas_beyond_the_context_are_refused_before_tokenizing(keyed, counting):
    """Seven tools of 60,000 characters each (each under max_tool_schema_bytes): 420,000
    characters, more than the 4,096-token context can hold whatever they tokenize to."""
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "b" * 60_000,
                                               "parameters": {"type": "object"}}} for i in range(7)]
    resp = chat(keyed, KEY_A, messages=[{"role": "user", "content": "Hi."}], tools=tools)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "context_length_exceeded"
    assert counting.calls == 0


def test_a_tenant_never_hits_a_grammar_another_tenant_compiled(keyed):
    grammars = keyed.app.state.gateway.model.runtime.service.grammars
    schema = {"type": "object", "properties": {"pin": {"type": "string", "pattern": "^[0-9]{4}$"}},
              "required": ["pin"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "pin", "schema": schema}}
    messages = [{"role": "user", "content": "The PIN?"}]

    def send(key: str) -> int:
        before = grammars.compiles
        resp = chat(keyed, key, messages=messages, response_format=response_format)
        assert resp.status_code == 200, resp.text
        return int(grammars.compiles - before)

    assert send(KEY_A) == 1 and send(KEY_A) == 0  # A's second request reuses A's grammar
    [grammar] = [g for g in grammars.cached(SALT_A) if "[0-9]{4}" in g]
    assert grammar not in grammars.cached(SALT_B)
    assert send(KEY_B) == 1  # B's first use is a miss: it compiles its own
    assert grammar in grammars.cached(SALT_B) and send(KEY_B) == 0
