"""Where each Responses answer went: a Responses conversation lives on the upstream that stored
it (`previous_response_id` is found only there, as are `GET`/`DELETE /v1/responses/{id}`), so the
proxy remembers, per tenant, which upstream answered each response id it relayed, and sends a
follow-up there first, even when its group has since spilled or moved. Bounded (least recently
used out); touched only from the event loop. A response id is looked up only for the tenant that
created it; with API keys, an id this key did not create here is "not found" for a follow-up too
(the upstreams see one key for every tenant, so they cannot tell), and so one tenant cannot reach
another's stored response through the proxy."""

from __future__ import annotations

from collections import OrderedDict

import orjson

from gateway.proxy.events import event_data

RESPONSE_ID_PREFIX = "resp_"


class ResponseHomes:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._homes: OrderedDict[tuple[str, str], str] = OrderedDict()

    def remember(self, tenant: str, response_id: str, upstream: str) -> None:
        if self.capacity <= 0:
            return
        key = (tenant, response_id)
        self._homes[key] = upstream
        self._homes.move_to_end(key)
        while len(self._homes) > self.capacity:
            self._homes.popitem(last=False)

    def home(self, tenant: str, response_id: str) -> str | None:
        upstream = self._homes.get((tenant, response_id))
        if upstream is not None:
            self._homes.move_to_end((tenant, response_id))
        return upstream

    def forget(self, tenant: str, response_id: str) -> None:
        self._homes.pop((tenant, response_id), None)


def answer_response_id(content: bytes) -> str | None:
    """The `id` of a whole Responses answer."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    response_id = body.get("id") if isinstance(body, dict) else None
    return response_id if isinstance(response_id, str) and response_id.startswith(RESPONSE_ID_PREFIX) else None


def stream_response_id(events: list[bytes]) -> str | None:
    """The response id a Responses stream's first events name (`response.created` carries it)."""
    for event in events:
        try:
            data = orjson.loads(event_data(event))
        except orjson.JSONDecodeError:
            continue
        response = data.get("response") if isinstance(data, dict) else None
        response_id = response.get("id") if isinstance(response, dict) else None
        if isinstance(response_id, str) and response_id.startswith(RESPONSE_ID_PREFIX):
            return response_id
    return None
