"""The openai npm package, unchanged, from Node against toolkv. On the scripted model: create,
streaming, the stream() helper, a forced call, a tool round trip and the SDK's own runTools agent
loop. On the real default model: runTools with a named tool runs it with schema-valid arguments,
the stream() helper with `tool_choice: "required"` streams a valid call as OpenAI does, and
`parse()` with a json_schema `response_format` returns the object. `npm ci` installs the locked
package on a fresh clone."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.clients.forced import (
    CALL_MAX_TOKENS,
    CANCEL_REQUEST,
    DEFAULT_MODEL,
    MARKUP,
    RETAIL_SUBSET,
    STATUS_REQUEST,
    STRUCTURED_REQUEST,
    CancellationRequest,
    assert_streamed_forced_call,
    assert_valid_call,
    messages,
    retail_tools,
)
from tests.clients.scenario import (
    FINAL_ANSWER,
    MODEL,
    ORDER_ARGS,
    TOOLS,
    USER_ARGS,
    ask,
    hermes_calls,
    tool_result,
)

NODE_DIR = Path(__file__).resolve().parent / "node"
EXPECTED = [("get_order_details", ORDER_ARGS), ("get_user_details", USER_ARGS)]


@pytest.fixture(scope="module")
def node() -> str:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("Node.js and npm are needed for the openai npm client test")
    if not (NODE_DIR / "node_modules" / "openai").is_dir():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True, timeout=600,
                       capture_output=True)
    return node


def run_client(node: str, api_url: str, spec: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run([node, "client.mjs", api_url, json.dumps(spec)], cwd=NODE_DIR,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout))


@pytest.fixture(scope="module")
def results(node: str, scripted_server) -> dict[str, Any]:
    return run_client(node, scripted_server.api_url, {
        "suite": "scripted", "model": MODEL, "tools": TOOLS,
        "twoCalls": ask(hermes_calls(*EXPECTED)),
        "oneCall": ask(hermes_calls(EXPECTED[0])),
        "forcedContinuation": ask(json.dumps(ORDER_ARGS) + "}\n</tool_call>"),
        "toolResult": tool_result({"status": "delivered"}, FINAL_ANSWER)})


def calls(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    for call in message["tool_calls"]:
        assert call["id"].startswith("call_") and call["type"] == "function"
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]


def test_create_returns_tool_calls(results, openai_schema):
    openai_schema("CreateChatCompletionResponse", results["create"])
    choice = results["create"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert calls(choice["message"]) == EXPECTED


def test_stream_chunks_carry_each_name_once_then_arguments(results, openai_schema):
    names, args = {}, {}
    for chunk in results["chunks"]:
        openai_schema("CreateChatCompletionStreamResponse", chunk)
        for part in (p for c in chunk["choices"] for p in c["delta"].get("tool_calls") or ()):
            if "name" in part.get("function", {}):
                assert part["index"] not in names
                names[part["index"]] = part["function"]["name"]
            args[part["index"]] = args.get(part["index"], "") + part["function"].get("arguments", "")
    assert [(names[i], json.loads(args[i])) for i in sorted(names)] == EXPECTED


def test_stream_helper_reports_finished_arguments_and_a_final_completion(results):
    helper = results["helper"]
    assert [(e["name"], json.loads(e["arguments"])) for e in helper["argumentsDone"]] == EXPECTED[:1]
    assert calls(helper["final"]["choices"][0]["message"]) == EXPECTED[:1]


def test_named_tool_choice_forces_the_call(results):
    assert calls(results["forced"]["choices"][0]["message"]) == EXPECTED[:1]


def test_round_trip_and_run_tools_finish_from_the_tool_result_with_cache_hits(results):
    second = results["roundTrip"]["second"]
    assert second["choices"][0]["message"]["content"] == FINAL_ANSWER
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    run = results["runTools"]
    assert run["ran"] == [{"name": "get_order_details", "args": ORDER_ARGS}]
    assert run["content"] == FINAL_ANSWER
    assert len(run["steps"]) == 2 and run["steps"][1]["prompt_tokens_details"]["cached_tokens"] > 0


# The real default model: forced and structured requests.

RETAIL = retail_tools(*RETAIL_SUBSET)


def strict_schema(model: type[CancellationRequest]) -> dict[str, Any]:
    return {**model.model_json_schema(), "additionalProperties": False}


@pytest.fixture(scope="module")
def forced_results(node: str, default_server) -> dict[str, Any]:
    return run_client(node, default_server.api_url, {
        "suite": "forced", "model": DEFAULT_MODEL, "tools": RETAIL, "maxTokens": CALL_MAX_TOKENS,
        "statusMessages": messages(STATUS_REQUEST), "namedTool": "get_order_details",
        "cancelMessages": messages(CANCEL_REQUEST), "toolResult": json.dumps({"status": "delivered"}),
        "structuredMessages": messages(STRUCTURED_REQUEST),
        "responseFormat": {"type": "json_schema", "json_schema": {
            "name": "CancellationRequest", "schema": strict_schema(CancellationRequest), "strict": True}}})


def test_run_tools_with_a_named_tool_runs_it_once_with_valid_arguments(forced_results):
    run = forced_results["runTools"]
    assert "error" not in run, run["error"]
    assert [r["name"] for r in run["ran"]] == ["get_order_details"], run["completions"][-1]["choices"]
    assert_valid_call(RETAIL, "get_order_details", run["ran"][0]["args"])


def test_stream_helper_with_required_tool_choice_streams_a_valid_call(forced_results):
    helper = forced_results["helper"]
    assert "error" not in helper, helper["error"]
    assert_streamed_forced_call(RETAIL, helper["chunks"])
    assert not any(m in "".join(helper["contentDeltas"]) for m in MARKUP)
    assert len(helper["argumentDeltas"]) >= 2 and helper["argumentsDone"]
    for done in helper["argumentsDone"]:
        assert_valid_call(RETAIL, done["name"], done["arguments"])
    assert helper["final"]["choices"][0]["finish_reason"] == "tool_calls"


def test_parse_with_a_json_schema_response_format_returns_the_object(forced_results):
    parse = forced_results["parse"]
    assert "error" not in parse, parse["error"]
    CancellationRequest.model_validate(parse["parsed"])
    assert parse["finish_reason"] == "stop"
