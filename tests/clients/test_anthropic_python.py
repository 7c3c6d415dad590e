"""anthropic-python, unchanged, against toolkv: the SDK's own agent loop,
`client.beta.messages.tool_runner(...)`, with its defaults. It runs over a server-side message
thread (`anthropic-beta: message-threads-2026-08-12`, `thread: {"type": "create"}`, then
`{"type": "continue", "previous_message_id": ...}` with only the tool results), which toolkv
serves: each continuation is answered with the whole conversation (its prompt is the prompt of
the same conversation sent whole), whole and streamed. A thread the server does not hold (never
kept, or lost) is Anthropic's 404 `thread_not_found`, on which the SDK replays the conversation
and the loop still finishes. Replies come from the scripted model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from anthropic import beta_tool

from gateway.api.app import create_app
from gateway.settings import load_settings
from tests.clients.scenario import FINAL_ANSWER, MODEL, ORDER_ARGS, ORDER_ID, SYSTEM, hermes_calls, tool_result
from tests.support.family_models import script, scripted_runtime
from tests.support.server import LiveServer, serve_app

THREADS_BETA = "message-threads-2026-08-12"
FIRST_TURN = [{"role": "user", "content": script(hermes_calls(("get_order_details", ORDER_ARGS)))}]


class Recorder:
    """The SDK's requests to /v1/messages, as sent: (headers, JSON body, status)."""

    def __init__(self) -> None:
        self.sent: list[tuple[httpx.Headers, dict[str, Any], int]] = []

    def on_response(self, response: httpx.Response) -> None:
        request = response.request
        if request.url.path.endswith("/v1/messages"):
            self.sent.append((request.headers, json.loads(request.content), response.status_code))


def sdk(live: LiveServer, recorder: Recorder) -> anthropic.Anthropic:
    hooks = {"response": [recorder.on_response]}
    return anthropic.Anthropic(base_url=live.base_url, api_key="unused", max_retries=0,
                               http_client=anthropic.DefaultHttpxClient(event_hooks=hooks))


def order_tool(ran: list[str]) -> Any:
    @beta_tool
    def get_order_details(order_id: str) -> str:
        """Get the status and details of an order.

        Args:
            order_id: The order's id, such as #W2378156.
        """
        ran.append(order_id)
        return tool_result({"status": "delivered", "order_id": order_id}, FINAL_ANSWER)

    return get_order_details


def count(live: LiveServer, body: dict[str, Any]) -> int:
    fields = {k: body[k] for k in ("model", "system", "tools", "messages", "tool_choice") if k in body}
    resp = httpx.post(live.api_url + "/messages/count_tokens", json=fields, timeout=60)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["input_tokens"])


def prompt_of(usage: Any) -> int:
    return int(usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_default_tool_runner_finishes_over_a_thread(scripted_server, stream):
    """Fails on 8363295: `thread` was ignored, so a continuation was answered without the
    conversation (here its prompt was the tool result alone)."""
    recorder, ran = Recorder(), []
    client = sdk(scripted_server, recorder)
    runner = client.beta.messages.tool_runner(model=MODEL, max_tokens=200, system=SYSTEM, messages=FIRST_TURN,
                                              tools=[order_tool(ran)], stream=stream)
    replies = [item.get_final_message() if stream else item for item in runner]
    assert ran == [ORDER_ID]
    assert [reply.stop_reason for reply in replies] == ["tool_use", "end_turn"]
    assert [(b.type, b.text) for b in replies[-1].content] == [("text", FINAL_ANSWER)]
    (first_headers, first, _), (later_headers, later, status) = recorder.sent
    assert THREADS_BETA in first_headers["anthropic-beta"] and THREADS_BETA in later_headers["anthropic-beta"]
    assert first["thread"] == {"type": "create"} and status == 200
    assert later["thread"] == {"type": "continue", "previous_message_id": replies[0].id}
    assert "system" not in later and "tools" not in later
    assert [block["type"] for message in later["messages"] for block in message["content"]] == ["tool_result"]
    # the continuation's prompt is the whole conversation's: what it counts sent whole
    whole = {**first, "messages": [*FIRST_TURN, {"role": "assistant", "content": [
        b.model_dump(exclude_none=True) for b in replies[0].content]}, *later["messages"]]}
    assert prompt_of(replies[1].usage) == count(scripted_server, whole) > prompt_of(replies[0].usage)


def test_a_thread_the_server_does_not_hold_is_anthropics_404_and_the_sdk_replays(scripted_server):
    recorder = Recorder()
    client = sdk(scripted_server, recorder)
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.beta.messages.create(model=MODEL, max_tokens=20, messages=FIRST_TURN,
                                    thread={"type": "continue", "previous_message_id": "msg_never_sent"})
    error = caught.value.body["error"]
    assert error["type"] == "not_found_error" and error["details"] == {"error_code": "thread_not_found"}
    assert "msg_never_sent" in error["message"]
    # each reply is continued once: a second continuation from the same reply is not found either
    first = client.beta.messages.create(model=MODEL, max_tokens=200, system=SYSTEM, messages=FIRST_TURN,
                                        tools=[order_tool([]).to_dict()], thread={"type": "create"})
    [call] = [block for block in first.content if block.type == "tool_use"]
    result = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                            "content": tool_result({"status": "delivered"}, FINAL_ANSWER)}]}]
    again = {"type": "continue", "previous_message_id": first.id}
    second = client.beta.messages.create(model=MODEL, max_tokens=50, messages=result, thread=again)
    assert [block.text for block in second.content if block.type == "text"] == [FINAL_ANSWER]
    with pytest.raises(anthropic.NotFoundError):
        client.beta.messages.create(model=MODEL, max_tokens=50, messages=result, thread=again)
    with pytest.raises(anthropic.BadRequestError) as repeated:  # system and tools are the thread's
        client.beta.messages.create(model=MODEL, max_tokens=50, messages=result, system=SYSTEM,
                                    thread={"type": "continue", "previous_message_id": second.id})
    assert repeated.value.body["error"]["message"].startswith("'system' is taken from the thread")


@pytest.fixture(scope="module")
def forgetful(tiny_model_dir, tmp_path_factory) -> Iterator[LiveServer]:
    """A server that keeps no threads (nor responses): every continuation is not found."""
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "served_model_name": MODEL,
                                        "min_prefix_tokens": 8, "disk_budget_bytes": 0, "max_stored_responses": 0,
                                        "cache_dir": str(tmp_path_factory.mktemp("cache"))}, environ={})
    with serve_app(create_app(settings, scripted_runtime)) as live:
        yield live


def test_the_default_tool_runner_finishes_when_the_server_loses_its_threads(forgetful):
    recorder, ran = Recorder(), []
    runner = sdk(forgetful, recorder).beta.messages.tool_runner(
        model=MODEL, max_tokens=200, system=SYSTEM, messages=FIRST_TURN, tools=[order_tool(ran)])
    final = runner.until_done()
    assert ran == [ORDER_ID] and [(b.type, b.text) for b in final.content] == [("text", FINAL_ANSWER)]
    threads = [(body.get("thread") or {}).get("type") for _, body, _ in recorder.sent]
    statuses = [status for _, _, status in recorder.sent]
    # the continuation is not found; the SDK replays the whole conversation under a new thread
    assert list(zip(threads, statuses, strict=True)) == [("create", 200), ("continue", 404), ("create", 200)]
    assert len(recorder.sent[-1][1]["messages"]) == 3
