"""Asking every upstream the same question at once: `ask_all`, the one fan-out behind the health
probes and the union of `/v1/models` (gateway/proxy/upstream_info.py), pinning and the fleet view
(gateway/proxy/fleet/: the cache, metrics and dashboard across the upstreams). Each call is
bounded: `timeout_s` for each wait and for the whole answer, which is read raw with a byte cap
(gateway/proxy/bounded.py). An upstream that does not answer, or answers what the proxy will not
read, is reported in its `UpstreamAnswer`, never raised: a gone upstream costs a short wait and its
name in the answer, never a view that fails or hangs."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import orjson

from gateway.proxy.bounded import Unreadable, fetch

Failure = Literal["unreachable", "unreadable"]


@dataclass(frozen=True, slots=True)
class UpstreamAnswer:
    url: str  # the upstream's base URL
    status: int | None = None  # None: nothing was read (`failure` says why)
    body: bytes = b""
    # unreachable: no connection, or no answer in time; unreadable: over the cap, compressed, or too slow
    failure: Failure | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200

    def json_object(self) -> dict[str, Any] | None:
        """A 200's body as a JSON object; None for anything else."""
        if not self.ok:
            return None
        try:
            value = orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return None
        return value if isinstance(value, dict) else None


async def ask_all(client: httpx.AsyncClient, urls: Sequence[str], method: str, path: str, *, timeout_s: float,
                  limit_bytes: int, headers: Mapping[str, str] | None = None,
                  content: bytes | None = None) -> list[UpstreamAnswer]:
    """Every upstream's answer to `method path` (each URL is a base URL), in the order of `urls`."""
    return list(await asyncio.gather(*(ask(client, url, method, path, timeout_s=timeout_s, limit_bytes=limit_bytes,
                                           headers=headers, content=content) for url in urls)))


async def ask(client: httpx.AsyncClient, url: str, method: str, path: str, *, timeout_s: float, limit_bytes: int,
              headers: Mapping[str, str] | None = None, content: bytes | None = None) -> UpstreamAnswer:
    try:
        resp, body = await fetch(client, method, url + path, limit=limit_bytes, timeout_s=timeout_s,
                                 headers=headers, content=content)
    except httpx.HTTPError:
        return UpstreamAnswer(url, failure="unreachable")
    except Unreadable:
        return UpstreamAnswer(url, failure="unreadable")
    return UpstreamAnswer(url, resp.status_code, body)
