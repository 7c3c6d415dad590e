"""Responses through the proxy: a conversation lives on the upstream that stored it, so a
follow-up (`previous_response_id`) goes there even when its tool group is homed elsewhere, and
`GET` / `DELETE /v1/responses/{id}` (and its input items) reach that upstream; an id the proxy
did not relay for this key is not found."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from gateway.edge.admission import _salt
from tests.proxy.conftest import home_of, metric, proxy

KEYS = ("key-a", "key-b")


SALT = _salt(KEYS[0].encode())  # what KEYS[0]'s requests are routed by


def instructions_homed_apart(upstreams: list[Any]) -> tuple[str, str]:
    """Two instructions (no tools) whose groups have different home upstreams for KEYS[0]."""
    first = "You keep notes. Answer briefly."
    home = home_of(upstreams, first, [], SALT)
    second = next(text for n in range(100)
                  if home_of(upstreams, text := f"You file claims, desk {n}.", [], SALT) is not home)
    return first, second


def test_a_follow_up_goes_where_its_previous_response_is_stored_and_can_be_fetched_there(toolkv_upstreams):
    first, second = instructions_homed_apart(toolkv_upstreams)
    stored_on = home_of(toolkv_upstreams, first, [], SALT)
    with proxy(toolkv_upstreams, api_keys=KEYS) as live:
        client = openai.OpenAI(base_url=live.api_url, api_key=KEYS[0], max_retries=0, timeout=120)
        opening = client.responses.create(model="tiny-llama", instructions=first, input="Remember: blue.",
                                          max_output_tokens=4, temperature=0)
        with client.responses.stream(model="tiny-llama", instructions=second, input="And the colour?",
                                     previous_response_id=opening.id, max_output_tokens=4,
                                     temperature=0) as stream:
            [follow_up] = [event.response for event in stream  # its group's home never saw `opening`
                           if event.type in ("response.completed", "response.incomplete")]
        routed = live.metrics()
        assert metric(routed, "toolkv_upstream_routed_total", upstream=stored_on.base_url, route="stored") == 1

        again = client.responses.create(model="tiny-llama", input="Once more?", previous_response_id=follow_up.id,
                                        max_output_tokens=2, temperature=0)  # the streamed one is known too
        assert client.responses.retrieve(opening.id).id == opening.id
        assert [item.type for item in client.responses.input_items.list(again.id)] == ["message"]

        other = openai.OpenAI(base_url=live.api_url, api_key=KEYS[1], max_retries=0, timeout=120)
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(opening.id)  # another key's response, though on the same upstream
        with pytest.raises(openai.BadRequestError) as refused:  # nor can it be continued by another key
            other.responses.create(model="tiny-llama", input="What colour?", previous_response_id=opening.id,
                                   max_output_tokens=2)
        assert refused.value.code == "previous_response_not_found"
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve("resp_" + "0" * 32)

        client.responses.delete(opening.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(opening.id)
        resp = httpx.get(f"{live.api_url}/responses/{opening.id}", headers={"authorization": f"Bearer {KEYS[0]}"},
                         timeout=30)
        assert resp.status_code == 404 and resp.json()["error"]["param"] == "response_id"
