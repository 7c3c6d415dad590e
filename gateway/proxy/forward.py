"""Forwarding one request with httpx: try the route's upstreams in order until one answers (no
connection, a 5xx, or a stream that ends or breaks before its first event moves on to the next),
then hand the answer back whole, or relay its stream event by event as the bytes arrive, byte
for byte (less the usage chunk a client did not ask for). Once the client has a stream's first
event, a failure ends that stream with an error event.

Bounded (gateway/proxy/bounded.py): raw bytes only, never decompressed; a whole answer, or one
stream event, of at most `upstream_max_body_bytes`; a stream whose next data event does not come
within `upstream_event_timeout_s` (keep-alive comments do not count) has failed; an upstream's
redirect or strange status is its failure, and only the headers the proxy means to send pass."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import anyio
import httpx
import orjson

from gateway.errors import BadGateway, UpstreamUnavailable, error_envelope
from gateway.protocol.messages import error_body as anthropic_error
from gateway.proxy.bounded import JSON_TYPE, Unreadable, check_encoding, passed_headers, passed_status, read_body
from gateway.proxy.events import EventSplitter, StreamBroken, body_usage, ends_stream, event_usage, has_data
from gateway.proxy.exchange import Exchange
from gateway.proxy.metrics import Usage
from gateway.proxy.routing import Route
from gateway.proxy.shaping import Forward, Kind
from gateway.proxy.upstreams import Release, UpstreamPool

log = logging.getLogger(__name__)

STREAM_HEADERS = {"content-type": "text/event-stream; charset=utf-8",
                  "cache-control": "no-cache", "x-accel-buffering": "no"}  # no buffering on the way
JSON_HEADERS = {"content-type": JSON_TYPE}


@dataclass(frozen=True, slots=True)
class Answer:
    """An upstream's whole answer (a 4xx too), passed to the client as it is."""

    upstream: str
    status: int
    headers: dict[str, str]
    content: bytes
    body: dict[str, Any] | None = None  # a 200's JSON object, parsed once (its usage is read from it)


@dataclass(frozen=True, slots=True)
class Opened:
    """A stream whose first events have arrived: from here on it is the client's."""

    upstream: str
    headers: dict[str, str]
    response: httpx.Response
    chunks: AsyncIterator[bytes]
    splitter: EventSplitter
    first: list[bytes]
    first_at: float  # perf_counter when the first data event arrived
    release: Release


class Bounds(NamedTuple):
    """How much of an upstream's answer the proxy reads, and how long it waits for it."""

    max_bytes: int  # a whole answer, or one stream event
    event_timeout_s: float  # a stream's next data event; a whole answer's body once its headers are in


@dataclass(frozen=True, slots=True)
class Failure:
    upstream: str
    answered: bool  # it sent an HTTP answer (a 5xx, a stream that broke) rather than none
    reason: str


class Forwarder:
    def __init__(self, client: httpx.AsyncClient, pool: UpstreamPool, bounds: Bounds) -> None:
        self.client = client
        self.pool = pool
        self.metrics = pool.metrics
        self.bounds = bounds

    async def open(self, fwd: Forward, route: Route, headers: Mapping[str, str], exchange: Exchange,
                   held: Release) -> Answer | Opened:
        """The first upstream's answer, trying the next after each failure; 503 when none
        answered, 502 when they answered with errors. `held` is the in-flight slot the caller
        took on `route.order[0]` when it routed (so the next request routed sees it)."""
        failures: list[Failure] = []
        for attempt, url in enumerate(route.order):
            self.metrics.routed.labels(upstream=url, route="retry" if attempt else route.reason).inc()
            exchange.upstream, exchange.attempts = url, attempt + 1
            release = held if attempt == 0 else self.pool.acquire(url)
            attempt_on = self._open_stream if fwd.stream else self._post
            result = await attempt_on(url, fwd, headers, release)
            if not isinstance(result, Failure):
                self.pool.mark_up(url)
                return result
            self.pool.mark_down(url)
            log.warning("upstream %s failed: %s", url, result.reason,
                        extra={"toolkv": {"request_id": exchange.request_id}})
            failures.append(result)
        raise no_upstream(failures)

    async def _post(self, url: str, fwd: Forward, headers: Mapping[str, str], release: Release) -> Answer | Failure:
        resp: httpx.Response | None = None
        try:
            request = self.client.build_request("POST", url + fwd.path, content=fwd.body, headers=dict(headers))
            resp = await self.client.send(request, stream=True)
            content = await read_body(resp, self.bounds.max_bytes, self.bounds.event_timeout_s)
        except (httpx.HTTPError, Unreadable) as exc:
            return self._failed(url, exc, answered=resp is not None)
        finally:
            await close_quietly(resp)
            release()
        return self._answer(url, resp, content, headers)

    async def _open_stream(self, url: str, fwd: Forward, headers: Mapping[str, str],
                           release: Release) -> Answer | Opened | Failure:
        resp: httpx.Response | None = None
        opened: Opened | None = None
        try:
            request = self.client.build_request("POST", url + fwd.path, content=fwd.body, headers=dict(headers))
            resp = await self.client.send(request, stream=True)
            if resp.status_code == 200 and is_event_stream(resp.headers):
                check_encoding(resp.headers)
                opened = await self._first_events(url, resp, release)
                if opened is None:
                    return self._failed(url, StreamBroken("the stream ended before its first event"), True)
                return opened
            content = await read_body(resp, self.bounds.max_bytes, self.bounds.event_timeout_s)
            return self._answer(url, resp, content, headers)
        except (httpx.HTTPError, StreamBroken, Unreadable) as exc:
            return self._failed(url, exc, answered=resp is not None)
        finally:
            if opened is None:  # a stream handed on is closed by its relay
                await close_quietly(resp)
                release()

    async def _first_events(self, url: str, resp: httpx.Response, release: Release) -> Opened | None:
        """The stream up to its first data event (a keep-alive comment before it commits nothing),
        raw bytes as they came; Unreadable when it does not come within the event timeout."""
        chunks = resp.aiter_raw()
        splitter = EventSplitter(self.bounds.max_bytes)
        first: list[bytes] = []
        deadline = anyio.current_time() + self.bounds.event_timeout_s
        while (data := await self._next(chunks, deadline)) is not None:
            first += splitter.feed(data)
            if any(has_data(event) for event in first):
                return Opened(url, passed_headers(resp.headers, STREAM_HEADERS), resp, chunks, splitter, first,
                              time.perf_counter(), release)
        return None

    async def _next(self, chunks: AsyncIterator[bytes], deadline: float) -> bytes | None:
        """A stream's next bytes (None at its end); Unreadable past `deadline` (anyio's clock)."""
        try:
            with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                return await anext(chunks, None)
        except TimeoutError:
            raise Unreadable(f"no data event within {self.bounds.event_timeout_s:g} s") from None

    def _answer(self, url: str, resp: httpx.Response, content: bytes,
                headers: Mapping[str, str]) -> Answer | Failure:
        """A whole answer a client may get: a JSON object with a 200, or the client's own error (a
        JSON object too) with the credential the proxy sent (`headers`) written out of it; else the
        upstream's failure (an HTML error page is not an answer of the API the proxy serves)."""
        self.metrics.upstream_requests.labels(upstream=url, status=str(resp.status_code)).inc()
        if not passed_status(resp.status_code):
            return Failure(url, answered=True, reason=f"status {resp.status_code}")
        body = json_object(content)
        if body is None:
            return Failure(url, answered=True, reason=f"a {resp.status_code} whose body is not a JSON object")
        if resp.status_code != 200:
            content = _without_credential(content, headers)
        return Answer(url, resp.status_code, passed_headers(resp.headers, JSON_HEADERS), content,
                      body if resp.status_code == 200 else None)

    def _failed(self, url: str, exc: Exception, answered: bool) -> Failure:
        """The failure, in the proxy's own words: an exception's text may quote the upstream's
        bytes (a malformed status line), which never reach a client."""
        self.metrics.upstream_requests.labels(upstream=url, status="error").inc()
        if isinstance(exc, StreamBroken | Unreadable):  # worded here
            return Failure(url, answered, str(exc))
        if isinstance(exc, httpx.RemoteProtocolError):  # it answered, with something that is not HTTP
            return Failure(url, True, "a malformed HTTP answer")
        return Failure(url, answered, type(exc).__name__)

    async def relay(self, opened: Opened, fwd: Forward, exchange: Exchange,
                    release_quota: Release) -> AsyncGenerator[bytes, None]:
        """The stream's events as they arrive; the exchange is finished when it ends (499 when
        the client went away first)."""
        status = 499
        exchange.first_event_at = opened.first_at
        ended = any(ends_stream(fwd.kind, event) for event in opened.first)
        try:
            if head := self._kept(opened.first, fwd, exchange):
                yield head
            deadline = anyio.current_time() + self.bounds.event_timeout_s
            while (data := await self._next(opened.chunks, deadline)) is not None:
                events = opened.splitter.feed(data)
                if any(has_data(event) for event in events):
                    deadline = anyio.current_time() + self.bounds.event_timeout_s
                ended = ended or any(ends_stream(fwd.kind, event) for event in events)
                if kept := self._kept(events, fwd, exchange):
                    yield kept
            rest = opened.splitter.rest()  # a last event without its blank line still counts
            if not (ended or ends_stream(fwd.kind, rest)):  # cut off, though HTTP saw a clean end
                raise StreamBroken("the upstream closed the stream before its last event")
            if rest:
                yield rest
            status = 200
        except (httpx.HTTPError, StreamBroken, Unreadable) as exc:
            status = 502
            log.warning("upstream %s broke off a stream: %s", opened.upstream, exc,
                        extra={"toolkv": {"request_id": exchange.request_id}})
            yield stream_error(fwd.kind)
        finally:
            answer = "broken" if status == 502 else "200"  # a client that left is no fault of the upstream's
            self.metrics.upstream_requests.labels(upstream=opened.upstream, status=answer).inc()
            await close_quietly(opened.response)
            opened.release()
            release_quota()
            exchange.finish(status)

    def _kept(self, events: list[bytes], fwd: Forward, exchange: Exchange) -> bytes:
        """`events` less a usage-only chunk the client did not ask for; notes the usage."""
        kept = []
        for event in events:
            usage, usage_only = event_usage(fwd.kind, event)
            if usage is not None:
                exchange.usage = usage
            if not (usage_only and not fwd.client_usage):
                kept.append(event)
        return b"".join(kept)


def json_object(content: bytes) -> dict[str, Any] | None:
    """`content` as a JSON object; None when it is not one (an HTML error page, say)."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    return body if isinstance(body, dict) else None


def _without_credential(content: bytes, headers: Mapping[str, str]) -> bytes:
    """`content` with the API key the proxy sent upstream (`upstream_api_key`) hidden: an upstream
    may quote it back in an error ("bad key Bearer sk-...")."""
    sent = next((value for name, value in headers.items() if name.lower() == "authorization"), "")
    key = sent.rpartition(" ")[2].encode()
    return content.replace(key, b"<hidden>") if len(key) >= 8 else content


def answer_usage(kind: Kind, answer: Answer) -> Usage | None:
    """Usage of a whole 200 answer (None when it has none)."""
    return body_usage(kind, answer.body) if answer.body is not None else None


def no_upstream(failures: list[Failure]) -> BadGateway | UpstreamUnavailable:
    """The client's error: which upstreams failed how, without their addresses."""
    reasons = "; ".join(f"upstream {n + 1}: {f.reason}" for n, f in enumerate(failures))
    if any(f.answered for f in failures):
        return BadGateway(f"no upstream could serve the request ({reasons})")
    return UpstreamUnavailable(f"no upstream is reachable ({reasons})", headers={"Retry-After": "1"})


def stream_error(kind: Kind) -> bytes:
    """The event that ends a stream the upstream broke off (then `[DONE]` for chat/completions):
    in the API's own shape."""
    message, code = "the upstream broke off the stream", "upstream_error"
    if kind == "messages":  # Anthropic's error event ends the stream (no [DONE])
        return b"event: error\ndata: " + orjson.dumps(anthropic_error(message, 502)) + b"\n\n"
    if kind == "responses":
        event = {"type": "error", "code": code, "message": message, "param": None}
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"
    return b"data: " + orjson.dumps(error_envelope(message, "server_error", None, code)) + b"\n\ndata: [DONE]\n\n"


def is_event_stream(headers: httpx.Headers) -> bool:
    media_type: str = headers.get("content-type", "")
    return media_type.split(";")[0].strip().lower() == "text/event-stream"


async def close_quietly(resp: httpx.Response | None) -> None:
    """Close an upstream answer, even while the request is being cancelled (the client left)."""
    if resp is None:
        return
    with anyio.CancelScope(shield=True):
        try:
            await resp.aclose()
        except httpx.HTTPError:
            pass
