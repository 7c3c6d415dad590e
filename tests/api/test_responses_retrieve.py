"""Kept responses read back, as the openai SDK and a plain HTTP client see them:
`client.responses.retrieve` returns the response exactly as it was returned (whole or streamed,
logprobs and all), `client.responses.delete` forgets it (then GET is a 404 and continuing it a
400), `client.responses.input_items.list` pages through its input in OpenAI's list shape, and no
API key sees another's responses. Responses validate against the SDK's types, errors against
OpenAI's strict error schema."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from jsonschema import Draft202012Validator
from openai.types.responses import Response, ResponseItemList

from tests.api.conftest import RESPONSES_KEYS
from tests.conftest import STRICT_SPEC

MODEL = "tiny-llama"
KEYS = RESPONSES_KEYS
ITEMS = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "input_text", "text": "Look up order 7"}]},
    {"type": "function_call", "id": "fc_7", "call_id": "call_1", "name": "get_order", "arguments": "{\"id\": 7}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "{\"status\": \"shipped\"}"},
    {"role": "user", "content": "Thanks"},
]


def error_of(resp: httpx.Response, status: int) -> dict[str, Any]:
    """The error of a `status` response, valid for OpenAI's strict error schema."""
    assert resp.status_code == status, resp.text
    bundle = json.loads(STRICT_SPEC.read_text())
    schema = {"$schema": bundle["$schema"], "$defs": bundle["$defs"], "$ref": "#/$defs/ErrorResponse"}
    Draft202012Validator(schema).validate(resp.json())
    return dict(resp.json()["error"])


def call(live, method: str, path: str, key: str | None = None, **kwargs: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, live.api_url + path, headers=headers, timeout=60, **kwargs)


def create(live, key: str | None = None, **body: Any) -> dict[str, Any]:
    resp = call(live, "POST", "/responses", key, json={"model": MODEL, "input": "Hello", "max_output_tokens": 3,
                                                        "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


# ---- retrieve ----------------------------------------------------------------------------------


def test_a_response_is_retrieved_exactly_as_it_was_returned(live, client):
    returned = create(live, instructions="Be kind.", metadata={"run": "7"}, top_logprobs=2,
                      include=["message.output_text.logprobs"])
    got = call(live, "GET", f"/responses/{returned['id']}")
    assert got.status_code == 200 and got.json() == returned
    assert returned["output"][0]["content"][0]["logprobs"]  # kept with the rest
    sdk = client.responses.retrieve(returned["id"])
    Response.model_validate(got.json(), strict=True)
    assert (sdk.id, sdk.output_text, sdk.metadata, sdk.instructions) == (
        returned["id"], returned["output"][0]["content"][0]["text"], {"run": "7"}, "Be kind.")


def test_a_streamed_response_is_retrieved_as_its_final_event_gave_it(live):
    body = {"model": MODEL, "input": "Tell me more", "max_output_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", live.api_url + "/responses", json=body, timeout=60) as resp:
        data = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    final = data[-1]["response"]
    assert data[-1]["type"] in ("response.completed", "response.incomplete")
    assert call(live, "GET", f"/responses/{final['id']}").json() == final


def test_unknown_and_unstored_responses_are_not_found(live, client):
    unstored = create(live, store=False)
    for response_id in ("resp_nope", unstored["id"]):
        for path in (f"/responses/{response_id}", f"/responses/{response_id}/input_items"):
            error = error_of(call(live, "GET", path), 404)
            assert error["message"] == f"Response with id '{response_id}' not found."
            assert error["type"] == "invalid_request_error" and error["param"] == "response_id"
        error_of(call(live, "DELETE", f"/responses/{response_id}"), 404)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")


def test_retrieving_as_a_stream_is_a_400_naming_stream(live):
    response_id = create(live)["id"]
    assert error_of(call(live, "GET", f"/responses/{response_id}", params={"stream": "true"}), 400)["param"] == "stream"


# ---- delete ------------------------------------------------------------------------------------


def test_a_deleted_response_is_gone_and_cannot_be_continued(live, client):
    first = create(live)
    child = create(live, previous_response_id=first["id"])
    deleted = call(live, "DELETE", f"/responses/{first['id']}")
    assert deleted.status_code == 200
    assert deleted.json() == {"id": first["id"], "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first["id"])
    error = error_of(call(live, "POST", "/responses", json={"model": MODEL, "input": "More",
                                                             "previous_response_id": first["id"]}), 400)
    assert (error["param"], error["code"]) == ("previous_response_id", "previous_response_not_found")
    error_of(call(live, "DELETE", f"/responses/{first['id']}"), 404)  # once only
    # the response that continued it keeps its conversation
    assert create(live, input="Go on", previous_response_id=child["id"])["previous_response_id"] == child["id"]


# A generation long enough that the stream is still running when the requests below reach the server.
LONG_OUTPUT_TOKENS = 300


def test_a_streaming_response_is_retrieved_in_progress_and_then_as_it_ended(live, client):
    with client.responses.create(model=MODEL, input="Tell me a long story", max_output_tokens=LONG_OUTPUT_TOKENS,
                                 temperature=0, stream=True) as stream:
        events = iter(stream)
        created = next(events)
        assert created.type == "response.created"
        running = client.responses.retrieve(created.response.id)
        assert (running.status, running.output) == ("in_progress", [])
        items = client.responses.input_items.list(created.response.id)
        assert [item.content[0].text for item in items.data] == ["Tell me a long story"]
        final = list(events)[-1]
    assert final.type in ("response.completed", "response.incomplete")
    assert client.responses.retrieve(created.response.id).model_dump() == final.response.model_dump()


def test_a_delete_while_the_response_streams_sticks(live, client):
    """Round 3's finding: a DELETE sent while the response streamed answered 404, and the response
    was kept when the stream ended (a GET then returned it): the client's delete was lost."""
    with client.responses.create(model=MODEL, input="Tell me a long story", max_output_tokens=LONG_OUTPUT_TOKENS,
                                 temperature=0, stream=True) as stream:
        events = iter(stream)
        response_id = next(events).response.id
        assert client.responses.delete(response_id) is None
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)
        final = list(events)[-1]
    assert final.type in ("response.completed", "response.incomplete")
    assert final.response.store is False  # not kept: it says so
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response_id)
    error = error_of(call(live, "POST", "/responses", json={"model": MODEL, "input": "More",
                                                             "previous_response_id": response_id}), 400)
    assert error["code"] == "previous_response_not_found"


def test_the_sdk_deletes_a_response(live, client):
    response_id = create(live)["id"]
    assert client.responses.delete(response_id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response_id)


# ---- input items -------------------------------------------------------------------------------


def test_input_items_are_the_responses_own_input_newest_first(live):
    first = create(live)
    response = create(live, input=ITEMS, previous_response_id=first["id"])
    listed = call(live, "GET", f"/responses/{response['id']}/input_items")
    assert listed.status_code == 200, listed.text
    page = ResponseItemList.model_validate(listed.json(), strict=True)
    assert [item.type for item in page.data] == ["message", "function_call_output", "function_call", "message",
                                                 "message"]
    thanks, output, fn_call, order, developer = page.data
    assert (thanks.role, thanks.content[0].text) == ("user", "Thanks")
    assert (output.call_id, output.output) == ("call_1", "{\"status\": \"shipped\"}")
    assert (fn_call.id, fn_call.call_id, fn_call.name, fn_call.arguments) == ("fc_7", "call_1", "get_order",
                                                                              "{\"id\": 7}")
    assert (order.role, order.content[0].text) == ("user", "Look up order 7")
    assert (developer.role, developer.content[0].text) == ("developer", "Be brief.")
    assert (page.first_id, page.last_id, page.has_more) == (thanks.id, developer.id, False)
    again = call(live, "GET", f"/responses/{response['id']}/input_items").json()
    assert again == listed.json()  # the ids are kept, not made anew


def test_the_sdk_pages_through_input_items_in_either_order(live, client):
    response_id = create(live, input=ITEMS)["id"]
    first_page = client.responses.input_items.list(response_id, order="asc", limit=2)
    assert len(first_page.data) == 2 and first_page.has_more is True
    items = list(first_page)  # the SDK follows `after` page by page
    assert [getattr(item, "call_id", None) or item.content[0].text for item in items] == [
        "Be brief.", "Look up order 7", "call_1", "call_1", "Thanks"]
    newest_first = list(client.responses.input_items.list(response_id, limit=3))
    assert [item.id for item in newest_first] == [item.id for item in reversed(items)]


@pytest.mark.parametrize("query, param", [
    ({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"), ({"limit": "ten"}, "limit"),
    ({"order": "newest"}, "order"), ({"after": "msg_not_here"}, "after"),
])
def test_bad_list_queries_are_a_400_naming_the_field(live, query, param):
    response_id = create(live)["id"]
    error = error_of(call(live, "GET", f"/responses/{response_id}/input_items", params=query), 400)
    assert error["param"] == param


# ---- tenants -----------------------------------------------------------------------------------


def test_another_keys_response_is_not_found_and_cannot_be_deleted(secured):
    mine = create(secured, KEYS[0])["id"]
    for method, path in (("GET", f"/responses/{mine}"), ("GET", f"/responses/{mine}/input_items"),
                         ("DELETE", f"/responses/{mine}")):
        assert error_of(call(secured, method, path, KEYS[1]), 404)["message"] == f"Response with id '{mine}' not found."
        assert error_of(call(secured, method, path), 401)["code"] == "invalid_api_key"
    assert call(secured, "GET", f"/responses/{mine}", KEYS[0]).json()["id"] == mine  # still there


def test_only_the_last_max_stored_responses_of_a_key_can_be_retrieved(secured):
    """`max_stored_responses` = 2 per key: a third response drops the least recently used."""
    oldest, middle = (create(secured, KEYS[1])["id"] for _ in range(2))
    assert call(secured, "GET", f"/responses/{oldest}", KEYS[1]).status_code == 200  # now the most recent
    create(secured, KEYS[1])
    assert call(secured, "GET", f"/responses/{middle}", KEYS[1]).status_code == 404
    assert call(secured, "GET", f"/responses/{oldest}", KEYS[1]).status_code == 200
