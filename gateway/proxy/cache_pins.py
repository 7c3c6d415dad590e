"""`POST` and `DELETE /v1/cache/{id}/pin` through the proxy, and through the Ray ingress (whose
upstreams are its engine replicas): asked of every upstream at once. A group may live on several
(its home, the second choice it spilled to, where a retry or a failover sent it, or a disk tier
they share), and a pinned group stays pinned wherever it lives; an id is the same on upstreams
running the same model. An upstream without the entry (or without toolkv's cache API, as vLLM's
404) is left alone; the answer is the entry as an upstream holding it in RAM sees it, with the
upstreams it was pinned (or unpinned) on. The admin key (once keys are set) is checked here first.
An upstream that does not answer is named in a 503, never waited for long: the caller retries."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gateway.edge.cache_ids import checked_id, unknown_entry
from gateway.errors import UpstreamUnavailable
from gateway.proxy.headers import upstream_headers

PIN_PATH = "/v1/cache/{entry_id}/pin"
PIN_TIMEOUT_S = 30.0  # pinning writes the pin file under its lock, and may list a large disk tier
NOT_HELD = frozenset({404, 405})  # no such entry there, or no cache API at all

Label = Callable[[str], str]


@dataclass(frozen=True, slots=True)
class PinAnswer:
    url: str
    response: httpx.Response | None  # None: no answer in time

    @property
    def entry(self) -> dict[str, Any] | None:
        """The entry a 200 describes (None for anything else)."""
        if self.response is None or self.response.status_code != 200:
            return None
        try:
            body = orjson.loads(self.response.content)
        except orjson.JSONDecodeError:
            return None
        return body if isinstance(body, dict) else None


def add_pin_routes(target: FastAPI | APIRouter, label: Label = str, field: str = "upstreams") -> None:
    """Add the two routes to `target` (as routes of its own: the Ray ingress replaces the proxy's
    by path); each answer lists the upstreams that pinned (or unpinned) the entry under `field`,
    each as `label` names its base URL."""
    def route(method: Literal["POST", "DELETE"]) -> Callable[[str, Request], Awaitable[Response]]:
        async def change(entry_id: str, request: Request) -> Response:
            return await change_pin(request, method, entry_id, label, field)

        return change

    target.add_api_route(PIN_PATH, route("POST"), methods=["POST"], name="pin_everywhere")
    target.add_api_route(PIN_PATH, route("DELETE"), methods=["DELETE"], name="unpin_everywhere")


async def change_pin(request: Request, method: Literal["POST", "DELETE"], entry_id: str, label: Label,
                     field: str) -> Response:
    state = request.app.state
    state.keyring.admin(request)
    digest = checked_id(entry_id)
    answers = await asyncio.gather(*(_ask(request, method, url, digest) for url in state.pool.urls))
    done = [(a, entry) for a in answers if (entry := a.entry) is not None]
    names = [label(a.url) for a, _ in done]
    if (refusal := _refusal(answers, label, names)) is not None:
        return refusal
    if missing := [label(a.url) for a in answers if a.entry is None and _held_maybe(a)]:
        change = "pinned" if method == "POST" else "unpinned"
        raise UpstreamUnavailable(f"{', '.join(missing)} did not answer: the entry may not be {change} there "
                                  f"({change} on: {', '.join(names) or 'none'}); retry shortly",
                                  headers={"Retry-After": "1"})
    if not done:
        raise unknown_entry(digest)
    live = max((entry for _, entry in done),
               key=lambda entry: ("ram" in entry.get("tiers", ()), float(entry.get("last_used_at") or 0.0)))
    return JSONResponse({**live, field: names})


async def _ask(request: Request, method: str, url: str, digest: str) -> PinAnswer:
    client: httpx.AsyncClient = request.app.state.forwarder.client
    headers = upstream_headers(request)
    body = b"{}" if method == "POST" else None  # a POST carries JSON (a toolkv's browser guard asks for it)
    if body is None:
        headers.pop("content-type")
    try:
        response = await client.request(method, f"{url}/v1/cache/{digest}/pin", content=body, headers=headers,
                                        timeout=PIN_TIMEOUT_S)
    except httpx.HTTPError:
        return PinAnswer(url, None)
    return PinAnswer(url, response)


def _held_maybe(answer: PinAnswer) -> bool:
    """No answer, a 5xx, or a 200 that is not an entry: whether it holds the entry is unknown."""
    status = answer.response.status_code if answer.response is not None else None
    return status is None or status >= 500 or status == 200


def _refusal(answers: Sequence[PinAnswer], label: Label, done: list[str]) -> Response | None:
    """An upstream's client error other than "not held" (a refused key, a pin past its budget),
    passed on with the upstream named, and where the change was made nevertheless."""
    for answer in answers:
        response = answer.response
        if response is None or not 400 <= response.status_code < 500 or response.status_code in NOT_HELD:
            continue
        try:
            body = orjson.loads(response.content)
            error = body["error"]
            error["message"] = f"{label(answer.url)}: {error['message']}" + (
                f" (done on: {', '.join(done)})" if done else "")
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return Response(response.content, status_code=response.status_code, media_type="application/json")
        return JSONResponse(body, status_code=response.status_code)
    return None
