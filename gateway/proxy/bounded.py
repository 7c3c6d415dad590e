"""Reading what an upstream sends, bounded: the proxy asks every upstream for `identity` and reads
the raw bytes (httpx never decompresses anything for it, so a small compressed bomb cannot grow
in the proxy's memory); an answer in any other encoding, larger than `upstream_max_body_bytes`, or
slower than its deadline once its headers are in, is refused, and only the response headers the
proxy means to send reach its clients."""

from __future__ import annotations

from collections.abc import Mapping

import anyio
import httpx

# An upstream's response headers a client gets; everything else (Set-Cookie, CORS, Location and
# other redirect headers, hop-by-hop headers, the upstream's Server and Date) stays at the proxy. No
# Content-Type either: the proxy says its own (JSON, or an event stream), whatever the upstream said.
PASSED_HEADERS = frozenset({"cache-control", "retry-after", "server-timing", "openai-processing-ms",
                            "openai-version"})
PASSED_PREFIXES = ("x-ratelimit-",)
# toolkv's own header: a toolkv upstream's word on its cache, passed only as toolkv's API defines it
CACHE_HEADER, CACHE_RESULTS = "x-toolkv-cache", frozenset({"hit", "miss", "bypass", "skip"})
JSON_TYPE = "application/json"
IDENTITY = frozenset({"", "identity"})


class Unreadable(Exception):
    """An upstream answer the proxy will not read: compressed although identity was asked, larger
    than the bound, or too slow."""


def check_encoding(headers: httpx.Headers) -> None:
    encoding = headers.get("content-encoding", "").strip().lower()
    if encoding not in IDENTITY:
        raise Unreadable(f"the upstream answered in content-encoding '{encoding[:40]}' although the proxy "
                         "asked for identity")


async def read_body(resp: httpx.Response, limit: int, deadline_s: float) -> bytes:
    """`resp`'s raw body, at most `limit` bytes, within `deadline_s` of now."""
    check_encoding(resp.headers)
    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise Unreadable(f"the upstream's answer is {int(declared)} bytes, over the limit of {limit}")
    body = bytearray()
    try:
        with anyio.fail_after(deadline_s):
            async for chunk in resp.aiter_raw():
                body += chunk
                if len(body) > limit:
                    raise Unreadable(f"the upstream's answer is over the limit of {limit} bytes")
    except TimeoutError:
        raise Unreadable(f"the upstream's answer did not arrive whole within {deadline_s:g} s") from None
    return bytes(body)


async def fetch(client: httpx.AsyncClient, method: str, url: str, *, limit: int, timeout_s: float,
                headers: Mapping[str, str] | None = None, params: httpx.QueryParams | None = None,
                content: bytes | None = None) -> tuple[httpx.Response, bytes]:
    """A whole answer read with `read_body` (a lookup, not a generation: `timeout_s` bounds each
    wait and the body). Raises httpx.HTTPError or Unreadable."""
    request = client.build_request(method, url, headers=dict(headers or {}), params=params, content=content,
                                   timeout=timeout_s)
    resp = await client.send(request, stream=True)
    try:
        return resp, await read_body(resp, limit, timeout_s)
    finally:
        with anyio.CancelScope(shield=True):
            await resp.aclose()


def passed_headers(headers: httpx.Headers, defaults: Mapping[str, str] | None = None) -> dict[str, str]:
    """The upstream's headers a client may see (PASSED_HEADERS, and `X-Toolkv-Cache` with one of
    toolkv's values), over `defaults` (the proxy's own, Content-Type among them)."""
    passed = {**(defaults or {})}
    passed.update((name, value) for name, value in headers.items()
                  if (low := name.lower()) in PASSED_HEADERS or low.startswith(PASSED_PREFIXES)
                  or (low == CACHE_HEADER and value in CACHE_RESULTS))
    return passed


def passed_status(status: int) -> bool:
    """An upstream status a client may get as it is: a success (200: every endpoint relayed
    answers 200 when it succeeds) or the client's own error; a redirect, another 2xx (204, 299), a
    5xx or anything stranger is the upstream's failure (502 after the others)."""
    return status == 200 or 400 <= status < 500
