"""`POST` and `DELETE /v1/cache/{id}/pin`, asked of every server behind the proxy at once (proxy
mode's upstreams, the Ray ingress's replicas). A group may live on several (its home, the second
choice it spilled to, where a retry or a failover sent it, or a disk tier they share), and a pinned
group stays pinned wherever it lives; an id is the same on servers running the same model. A
server without the entry (or without toolkv's cache API, as vLLM's 404) is left alone; the answer
is the entry as a server holding it in RAM sees it, with the servers it was pinned (or unpinned) on
(`upstreams` or `replicas`, as the view names them). The admin key (once keys are set) is checked
here first. A server that does not answer is named in a 503, never waited for long: the caller
retries."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.edge.cache_ids import checked_id, unknown_entry
from gateway.errors import UpstreamUnavailable
from gateway.proxy.fan_out import UpstreamAnswer
from gateway.proxy.fleet.view import FleetView, ask_members, liveness, view_of
from gateway.proxy.state import proxy_state

PIN_PATH = "/v1/cache/{entry_id}/pin"
PIN_TIMEOUT_S = 30.0  # pinning writes the pin file under its lock, and may list a large disk tier
NOT_HELD = frozenset({404, 405})  # no such entry there, or no cache API at all


def add_pin_routes(router: APIRouter) -> None:
    def route(method: Literal["POST", "DELETE"]) -> Callable[[str, Request], Awaitable[Response]]:
        async def change(entry_id: str, request: Request) -> Response:
            return await change_pin(request, method, entry_id)

        return change

    router.add_api_route(PIN_PATH, route("POST"), methods=["POST"], name="pin_everywhere")
    router.add_api_route(PIN_PATH, route("DELETE"), methods=["DELETE"], name="unpin_everywhere")


async def change_pin(request: Request, method: Literal["POST", "DELETE"], entry_id: str) -> Response:
    proxy_state(request.app).keyring.admin(request)
    view = view_of(request)
    digest = checked_id(entry_id)
    # a POST carries JSON (a toolkv's browser guard asks for it)
    answers = await ask_members(request, method, f"/v1/cache/{digest}/pin", PIN_TIMEOUT_S,
                                content=b"{}" if method == "POST" else None)
    done = [(a, entry) for a in answers if (entry := a.json_object()) is not None]
    names = [view.name(a.url) for a, _ in done]
    if (refusal := _refusal(view, answers, names)) is not None:
        return refusal
    if missing := [view.name(a.url) for a in answers if _held_maybe(a) and a.json_object() is None]:
        change = "pinned" if method == "POST" else "unpinned"
        raise UpstreamUnavailable(f"{', '.join(missing)} did not answer: the entry may not be {change} there "
                                  f"({change} on: {', '.join(names) or 'none'}); retry shortly",
                                  headers={"Retry-After": "1"})
    if not done:
        raise unknown_entry(digest)
    live = max((entry for _, entry in done), key=liveness)
    return JSONResponse({**live, view.members: names})


def _held_maybe(answer: UpstreamAnswer) -> bool:
    """No answer, a 5xx, or a 200 that is not an entry: whether it holds the entry is unknown."""
    return answer.status is None or answer.status >= 500 or answer.ok


def _refusal(view: FleetView, answers: Sequence[UpstreamAnswer], done: list[str]) -> Response | None:
    """A server's client error other than "not held" (a refused key, a pin past its budget), passed
    on with the server named, and where the change was made nevertheless."""
    for answer in answers:
        if answer.status is None or not 400 <= answer.status < 500 or answer.status in NOT_HELD:
            continue
        try:
            body = orjson.loads(answer.body)
            error = body["error"]
            error["message"] = f"{view.name(answer.url)}: {error['message']}" + (
                f" (done on: {', '.join(done)})" if done else "")
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return Response(answer.body, status_code=answer.status, media_type="application/json")
        return JSONResponse(body, status_code=answer.status)
    return None
