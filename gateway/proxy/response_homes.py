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
    """Per tenant, the last `per_tenant` response ids relayed (so one busy key cannot push the
    others' out), and at most `capacity` in all (the least recently used tenant's go first)."""

    def __init__(self, capacity: int, per_tenant: int) -> None:
        self.capacity = capacity
        self.per_tenant = per_tenant
        self._tenants: OrderedDict[str, OrderedDict[str, str]] = OrderedDict()
        self._size = 0

    def remember(self, tenant: str, response_id: str, upstream: str) -> None:
        if self.capacity <= 0 or self.per_tenant <= 0:
            return
        homes = self._tenants.setdefault(tenant, OrderedDict())
        self._tenants.move_to_end(tenant)
        self._size += response_id not in homes
        homes[response_id] = upstream
        homes.move_to_end(response_id)
        if len(homes) > self.per_tenant:
            homes.popitem(last=False)
            self._size -= 1
        while self._size > self.capacity:
            oldest_tenant, oldest = next(iter(self._tenants.items()))
            oldest.popitem(last=False)
            self._size -= 1
            if not oldest:
                del self._tenants[oldest_tenant]

    def home(self, tenant: str, response_id: str) -> str | None:
        homes = self._tenants.get(tenant)
        upstream = homes.get(response_id) if homes is not None else None
        if homes is not None and upstream is not None:
            homes.move_to_end(response_id)
            self._tenants.move_to_end(tenant)
        return upstream

    def forget(self, tenant: str, response_id: str) -> None:
        homes = self._tenants.get(tenant)
        if homes is not None and homes.pop(response_id, None) is not None:
            self._size -= 1
            if not homes:
                del self._tenants[tenant]

    def __len__(self) -> int:
        return self._size


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
