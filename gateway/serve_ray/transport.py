"""The ingress side of the bridge: an httpx transport whose "network" is Ray Serve deployment
handles, so proxy mode's app (affinity routing, spill, retry before the first event, metrics)
serves a fleet of engine replicas unchanged. `http://engine-3/v1/...` goes to the handle named
`engine-3`; a stream comes back chunk by chunk (`handle.options(stream=True)`).

With API keys the proxy never passes a client's key upstream; here the replicas are the same
gateway, so the client's `Authorization` goes with the request (`ForwardClientKey` keeps it for
the request's task) and each replica derives the same tenant, salt and cache namespace as a
single gateway would."""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.serve_ray.asgi_call import ResponseHead

CLIENT_AUTHORIZATION: contextvars.ContextVar[bytes | None] = contextvars.ContextVar("client_authorization",
                                                                                   default=None)


class ForwardClientKey:
    """ASGI middleware: remembers the client's `Authorization` for the transport."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope["headers"]).get(b"authorization")
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
            head = await call.__anext__()
        except Exception as exc:  # the replica died, is unavailable or the call failed: retried elsewhere
            call.cancel()
            raise httpx.ConnectError(f"replica {request.url.host}: {type(exc).__name__}", request=request) from exc
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
        try:
            async for chunk in self._call:
                yield chunk
        except Exception as exc:  # the replica died mid-answer: a broken stream to the proxy
            raise httpx.ReadError(f"replica stream broke: {type(exc).__name__}", request=self._request) from exc

    async def aclose(self) -> None:
        self._call.cancel()  # the replica sees a disconnect and stops generating


def _headers(request: httpx.Request) -> list[tuple[bytes, bytes]]:
    headers = [(name.lower(), value) for name, value in request.headers.raw]
    client_key = CLIENT_AUTHORIZATION.get()
    if client_key is not None:
        headers = [(n, v) for n, v in headers if n != b"authorization"] + [(b"authorization", client_key)]
    return headers
