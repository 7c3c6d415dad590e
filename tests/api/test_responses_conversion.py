"""The Responses API's pieces without a server: the answer's events into Responses events (every
event valid for the SDK's type, numbered in order, items closed in output order; a failure ends
with `error` and `response.failed`; logprobs on the text deltas), input items into the generation's
messages and into listed items (and their pages), and the per-key response store's LRU order and deletes."""

from __future__ import annotations

import typing
from typing import Any

import pytest
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent

from adapters.base import ChatMessage, ToolCallIn, ToolSpec
from gateway.api.responses.retrieval import InputItemsQuery, listed_items, page
from gateway.api.responses.store import ResponseStore, StoredResponse, Turn, stored_bytes
from gateway.api.responses.stream import ResponseEvents
from gateway.errors import BadRequest, GenerationFailed
from gateway.protocol.answer import Answer, CallArguments, CallStarted, Ended, Started, TextWritten, ToolCall, Usage
from gateway.protocol.generation import ToolChoice
from gateway.protocol.responses import ResponsesRequest, input_messages, to_generation
from gateway.protocol.responses_output import ResponseShape, output_of

pytestmark = pytest.mark.model_free  # no model, no server: in the fast subset

EVENT_TYPES = {cls.model_fields["type"].annotation.__args__[0]: cls
               for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
USAGE = Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=4)


def entry(token: str, logprob: float = -1.0) -> dict[str, Any]:
    """A chat logprobs entry (one alternative: itself)."""
    raw = list(token.encode())
    return {"token": token, "logprob": logprob, "bytes": raw,
            "top_logprobs": [{"token": token, "logprob": logprob, "bytes": raw}]}


def run(answer: list[Any]) -> tuple[list[dict[str, Any]], ResponseEvents]:
    """The events of a stream that started and then wrote `answer` (not yet ended)."""
    stream = ResponseEvents(ResponseShape.of("resp_1", ResponsesRequest(), "m"))
    events = []
    for event in [Started(Usage(10, 0, 4), forced_call=False), *answer]:
        events += stream.feed(event)
    return events, stream


def check(events: list[dict[str, Any]]) -> None:
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        EVENT_TYPES[event["type"]].model_validate(event, strict=True)


def test_text_then_two_calls_close_each_item_before_the_next_opens():
    events, stream = run([TextWritten("Let me "), TextWritten("check."), CallStarted(0, "call_a", "f"),
                          CallArguments(0, '{"x": '), CallArguments(0, "1}"), CallStarted(1, "call_b", "g"),
                          CallArguments(1, "{}")])
    closing, body = stream.finish(Ended("tool_calls", USAGE))
    events += closing
    check(events)
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    final = Response.model_validate(body, strict=True)
    assert final.status == "completed" and final.output_text == "Let me check."
    assert [(o.type, getattr(o, "arguments", None)) for o in final.output] == [
        ("message", None), ("function_call", '{"x": 1}'), ("function_call", "{}")]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [0, 1, 2]


def test_a_length_finish_is_incomplete_and_so_is_its_message():
    events, stream = run([TextWritten("Once upon")])
    closing, body = stream.finish(Ended("length", USAGE))
    check(events + closing)
    assert closing[-1]["type"] == "response.incomplete"
    final = Response.model_validate(body, strict=True)
    assert final.incomplete_details.reason == "max_output_tokens" and final.output[0].status == "incomplete"


def test_an_empty_answer_is_one_empty_message_as_in_a_whole_response():
    events, stream = run([])
    closing, body = stream.finish(Ended("stop", USAGE))
    check(events + closing)
    final = Response.model_validate(body, strict=True)
    assert [(o.type, o.content[0].text) for o in final.output] == [("message", "")]


def test_a_failure_ends_with_an_error_event_and_response_failed():
    events, stream = run([TextWritten("Hel")])
    failing, body = stream.fail(GenerationFailed("the model produced non-finite logits"))
    events += failing
    check(events)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert (events[-2]["code"], events[-2]["param"]) == ("generation_failed", None)
    failed = Response.model_validate(events[-1]["response"], strict=True)
    assert failed.status == "failed" and failed.error.code == "server_error" and body == events[-1]["response"]
    refused, _ = run([])[1].fail(BadRequest("the schema is too large", param="text.format"))
    assert (refused[0]["code"], refused[0]["param"]) == ("invalid_request_error", "text.format")
    assert refused[1]["response"]["error"]["code"] == "invalid_prompt"


def test_each_text_delta_carries_its_tokens_logprobs_and_the_done_event_all_of_them():
    """An end token's entry (no text) comes with the answer's end: it joins the `.done` event, as it
    is in chat's whole `logprobs.content`."""
    hel, lo, end = entry("Hel", -0.5), entry("lo", -0.25), {**entry(""), "logprob": -2.0}
    events, stream = run([TextWritten("Hel", [hel]), TextWritten("lo", [lo])])
    closing, body = stream.finish(Ended("stop", USAGE, [end]))
    events += closing
    check(events)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [(e["delta"], e["logprobs"]) for e in deltas] == [("Hel", [hel]), ("lo", [lo])]
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    [part_done] = [e for e in events if e["type"] == "response.content_part.done"]
    assert done["logprobs"] == part_done["part"]["logprobs"] == [hel, lo, end]
    final = Response.model_validate(body, strict=True)
    part = final.output[0].content[0]
    assert [(lp.token, lp.logprob, lp.bytes) for lp in part.logprobs] == [("Hel", -0.5, list(b"Hel")),
                                                                         ("lo", -0.25, list(b"lo")), ("", -2.0, [])]
    assert part.logprobs[0].top_logprobs[0].token == "Hel"


def test_call_tokens_logprobs_are_not_text():
    held, tail, call = entry("Let"), entry(" me"), entry("<tool_call>")
    events, stream = run([TextWritten("Let me", [held, tail]), CallStarted(0, "call_a", "f", [call])])
    closing, body = stream.finish(Ended("tool_calls", USAGE, [entry("</tool_call>")]))
    check(events + closing)
    [delta] = [e for e in events if e["type"] == "response.output_text.delta"]
    assert delta["logprobs"] == [held, tail]
    assert body["output"][0]["content"][0]["logprobs"] == [held, tail]


def test_a_whole_answers_text_part_has_the_entries_that_spell_its_text_not_its_calls():
    entries = [entry("Hi"), entry("."), entry("<tool_call>"), entry("{}")]
    text, call = output_of(Answer("Hi.", (ToolCall("call_a", "f", "{}"),), "tool_calls", USAGE, entries))
    assert text["content"][0]["logprobs"] == entries[:2] and "logprobs" not in call
    [alone] = output_of(Answer("Hi.", (), "stop", USAGE, [*entries[:2], entry("")]))
    assert alone["content"][0]["logprobs"] == [*entries[:2], entry("")]  # all of them, as chat's


def test_logprobs_are_asked_only_with_the_include_value():
    asked = ResponsesRequest.model_validate({"input": "hi", "include": ["message.output_text.logprobs"],
                                             "top_logprobs": 3})
    sampling = to_generation(asked, []).sampling
    assert (sampling.logprobs, sampling.top_logprobs) == (True, 3)
    top_only = to_generation(ResponsesRequest.model_validate({"input": "hi", "top_logprobs": 3}), []).sampling
    assert (top_only.logprobs, top_only.top_logprobs) == (False, 0)  # as OpenAI: no include, no logprobs


def test_input_items_become_chat_messages_with_calls_joining_their_turn():
    req = ResponsesRequest.model_validate({"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Order 7?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get", "arguments": "{\"id\": 2}"},
        {"type": "function_call_output", "call_id": "c1", "output": "shipped"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "lost"}]},
    ], "tools": [{"type": "function", "name": "get", "parameters": {"type": "object"}, "strict": True}],
        "tool_choice": {"type": "function", "name": "get"}, "max_output_tokens": 9,
        "text": {"format": {"type": "json_object"}}})
    generation = to_generation(req, input_messages(req.input))
    calls = (ToolCallIn("c1", "get", "{}"), ToolCallIn("c2", "get", "{\"id\": 2}"))
    assert generation.messages == (
        ChatMessage("system", "Be brief."), ChatMessage("user", "Order 7?"),
        ChatMessage("assistant", "Checking.", calls), ChatMessage("tool", "shipped", tool_call_id="c1"),
        ChatMessage("tool", "lost", tool_call_id="c2"))
    assert generation.tools == (ToolSpec("get", None, {"type": "object"}),)
    assert generation.tool_choice == ToolChoice("required", named="get")
    assert (generation.max_tokens, generation.answer_schema, generation.answer_schema_given) == (
        9, {"type": "object"}, False)


def test_the_service_names_the_responses_fields():
    names = to_generation(ResponsesRequest.model_validate({"input": "hi"}), []).fields
    assert (names.messages, names.max_tokens, names.answer_schema, names.tool_parameters.format(2),
            names.allowed_tool.format(0)) == (
        "input", "max_output_tokens", "text.format", "tools[2].parameters", "tool_choice.tools[0].name")


def kept(response_id: str, *messages: dict[str, Any], parent: Turn | None = None) -> StoredResponse:
    return StoredResponse(Turn(response_id, messages, parent), {"id": response_id})


def test_the_store_drops_the_least_recently_used_response_of_that_tenant_only():
    store = ResponseStore(max_per_tenant=2)
    for response_id in ("a", "b"):
        store.put("t1", kept(response_id))
    store.put("t2", kept("x"))
    assert store.get("t1", "a") is not None  # a is now the most recent
    store.put("t1", kept("c"))
    assert [store.get("t1", r) is not None for r in ("a", "b", "c")] == [True, False, True]
    assert store.get("t2", "x") is not None and store.get("t2", "a") is None


def test_a_stored_response_keeps_its_whole_conversation_after_its_parent_leaves_the_index():
    store = ResponseStore(max_per_tenant=1)
    first = kept("a", {"role": "user", "content": "1"}, {"role": "assistant", "content": "2"})
    store.put("t", first)
    store.put("t", kept("b", {"role": "user", "content": "3"}, parent=first.turn))
    assert store.get("t", "a") is None
    stored = store.get("t", "b")
    assert stored is not None and [m["content"] for m in stored.turn.conversation()] == ["1", "2", "3"]


def test_a_deleted_response_is_gone_for_its_tenant_only_and_its_children_keep_their_conversation():
    store = ResponseStore(max_per_tenant=4)
    first = kept("a", {"role": "user", "content": "1"})
    store.put("t", first)
    store.put("t", kept("b", {"role": "user", "content": "2"}, parent=first.turn))
    assert not store.delete("other", "a") and store.get("t", "a") is not None
    assert store.delete("t", "a") and not store.delete("t", "a")
    assert store.get("t", "a") is None and len(store) == 1
    child = store.get("t", "b")
    assert child is not None and [m["content"] for m in child.turn.conversation()] == ["1", "2"]


def test_a_store_of_size_zero_keeps_nothing():
    store = ResponseStore(max_per_tenant=0)
    store.put("t", kept("a"))
    assert store.get("t", "a") is None and len(store) == 0


# ---- input items, listed ---------------------------------------------------------------------


def test_input_is_listed_as_openai_items_keeping_ids_that_were_sent():
    items = listed_items(ResponsesRequest.model_validate({"input": [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "assistant", "id": "msg_old", "content": [{"type": "output_text", "text": "Hi"}]},
        {"type": "function_call", "id": "fc_old", "call_id": "c1", "name": "get", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "ok"}]},
    ]}).input)
    assert [item["id"][:3] for item in items] == ["msg", "msg", "fc_", "fco"]
    assert items[1]["id"] == "msg_old" and items[2]["id"] == "fc_old"
    assert len({item["id"] for item in items}) == 4
    page_ = ResponseItemList.model_validate({"object": "list", "data": list(items), "first_id": items[0]["id"],
                                             "last_id": items[-1]["id"], "has_more": False}, strict=True)
    developer, assistant, call, output = page_.data
    assert developer.type == "message" and developer.role == "developer" and developer.content[0].text == "Be brief."
    assert assistant.role == "assistant" and assistant.content[0].text == "Hi"
    assert (call.call_id, call.name, call.arguments) == ("c1", "get", "{}")
    assert output.call_id == "c1" and output.output[0].text == "ok"
    [text] = listed_items("Hello")
    assert text["role"] == "user" and text["content"] == [{"type": "input_text", "text": "Hello"}]


def test_pages_run_newest_first_by_default_and_continue_after_an_item():
    items = tuple({"id": f"i{n}"} for n in range(5))

    def ids(**query: Any) -> tuple[list[str], bool]:
        listed = page(items, InputItemsQuery.model_validate(query))
        assert (listed["first_id"], listed["last_id"]) == (listed["data"][0]["id"], listed["data"][-1]["id"])
        return [item["id"] for item in listed["data"]], listed["has_more"]

    assert ids() == (["i4", "i3", "i2", "i1", "i0"], False)
    assert ids(order="asc", limit="2") == (["i0", "i1"], True)
    assert ids(order="asc", limit="2", after="i1") == (["i2", "i3"], True)
    assert ids(order="asc", after="i3") == (["i4"], False)
    assert ids(limit="3", after="i4") == (["i3", "i2", "i1"], True)


def test_the_store_keeps_at_most_its_byte_budget_per_tenant():
    def stored(n: int, text: str) -> StoredResponse:
        return StoredResponse(Turn(f"resp_{n}", ({"role": "user", "content": text},)), {"id": f"resp_{n}"})

    size = stored_bytes(stored(0, "x" * 1000))
    store = ResponseStore(max_per_tenant=100, max_bytes_per_tenant=size * 3)
    for n in range(5):
        store.put("a", stored(n, "x" * 1000))
    store.put("b", stored(9, "x" * 1000))
    assert [store.get("a", f"resp_{n}") is not None for n in range(5)] == [False, False, True, True, True]
    assert store.get("b", "resp_9") is not None  # each tenant has its own budget
    store.put("a", stored(7, "x" * (size * 4)))  # over the whole budget: kept nowhere, evicts nothing
    assert store.get("a", "resp_7") is None and store.get("a", "resp_2") is not None
    assert store.delete("a", "resp_2") and len(store) == 3
