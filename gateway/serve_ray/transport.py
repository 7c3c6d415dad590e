"""The ingress side of the bridge: an httpx transport whose "network" is Ray Serve deployment
handles, so proxy mode's app (affinity routing, spill, retry before the first event, metrics)
serves a fleet of engine replicas unchanged. `http://engine-3/v1/...` goes to the handle named
`engine-3`; a stream comes back chunk by chunk (`handle.options(stream=True)`).

With API keys the proxy never passes a client's key upstream; here the replicas are the same
gateway, so the client's key goes with the request (`ForwardClientKey` keeps it for the
request's task) and each replica derives the same tenant, salt and cache namespace as a
single gateway would.

httpx enforces its timeouts only on its own network, so this transport applies the request's read
timeout itself, to the answer's head and to each chunk after it: a probe (`/health`, with
`upstream_connect_timeout_s`) of a replica that is gone (Ray holds calls to a deployment with no
running replica until one starts) times out, and the ingress routes its groups elsewhere meanwhile."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.serve_ray.asgi_call import ResponseHead

CLIENT_AUTHORIZATION: contextvars.ContextVar[bytes | None] = contextvars.ContextVar("client_authorization",
                                                                                   default=None)


class ForwardClientKey:
    """ASGI middleware: remembers the client's key for the transport, as `Authorization` (a key
    sent as `x-api-key`, as Anthropic's clients send it, becomes its bearer form)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        sent = headers.get(b"authorization")
        if sent is None and (api_key := headers.get(b"x-api-key")):
            sent = b"Bearer " + api_key
        token = CLIENT_AUTHORIZATION.set(sent)
        try:
            await self.app(scope, receive, send)
        finally:
            CLIENT_AUTHORIZATION.reset(token)


class ReplicaTransport(httpx.AsyncBaseTransport):
    def __init__(self, handles: Mapping[str, Any]) -> None:
        self.handles = dict(handles)  # host name ("engine-0") -> DeploymentHandle

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        handle = self.handles.get(request.url.host)
        if handle is None:
            raise httpx.ConnectError(f"no replica named {request.url.host}", request=request)
        call = handle.options(stream=True).call.remote(request.method, request.url.path, request.url.query,
                                                       _headers(request), await request.aread())
        try:
            head = await asyncio.wait_for(call.__anext__(), read_timeout(request))
        except TimeoutError as exc:  # e.g. no replica of that name is running (Ray holds the call meanwhile)
            call.cancel()
            raise httpx.ReadTimeout(f"replica {request.url.host} did not answer in time", request=request) from exc
        except Exception as exc:  # the replica died, is unavailable or the call failed: retried elsewhere
            call.cancel()
            raise httpx.ConnectError(f"replica {request.url.host}: {type(exc).__name__}", request=request) from exc
        except BaseException:  # cancelled (the client left): Ray's wait does not cancel the call by itself
            call.cancel()
            raise
        if not isinstance(head, ResponseHead):
            call.cancel()
            raise httpx.RemoteProtocolError("a replica answered without a status", request=request)
        return httpx.Response(head.status, headers=head.headers, stream=ReplicaStream(call, request),
                              request=request)


class ReplicaStream(httpx.AsyncByteStream):
    def __init__(self, call: Any, request: httpx.Request) -> None:
        self._call = call
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        timeout = read_timeout(self._request)
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(self._call.__anext__(), timeout)
                except StopAsyncIteration:
                    return
                yield chunk
        except TimeoutError as exc:
            raise httpx.ReadTimeout("a replica's stream stalled", request=self._request) from exc
        except Exception as exc:  # the replica died mid-answer: a broken stream to the proxy
            raise httpx.ReadError(f"replica stream broke: {type(exc).__name__}", request=self._request) from exc

    async def aclose(self) -> None:
        self._call.cancel()  # the replica sees a disconnect and stops generating


def read_timeout(request: httpx.Request) -> float | None:
    """The request's httpx read timeout (the longest wait for the next bytes): the client's
    `upstream_read_timeout_s`, or a probe's shorter one; httpx applies it only to its own network."""
    timeouts = request.extensions.get("timeout", {})
    read = timeouts.get("read") if isinstance(timeouts, dict) else None
    return float(read) if read is not None else None


def _headers(request: httpx.Request) -> list[tuple[bytes, bytes]]:
    headers = [(name.lower(), value) for name, value in request.headers.raw]
    client_key = CLIENT_AUTHORIZATION.get()
    if client_key is not None:
        headers = [(n, v) for n, v in headers if n != b"authorization"] + [(b"authorization", client_key)]
    return headers
