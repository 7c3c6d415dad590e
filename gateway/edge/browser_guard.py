"""Defences against what a web page in the user's browser can make it send to the gateway.

A page on any site may POST to `http://127.0.0.1:8000` without a CORS preflight as long as the
request is "simple" (a `text/plain` or form body); the gateway parses the body as JSON whatever its
Content-Type, so such a POST would run a chat or warm the cache (CSRF). Requests that change
something must therefore say `Content-Type: application/json`, which a page can only send after a
preflight that the gateway never approves (it sends no CORS headers).

A page can also rebind its own host name to 127.0.0.1 (DNS rebinding): the browser then treats
the gateway as same-origin with the page and lets it read the answers (`/v1/cache` lists tool
names). The browser still sends the page's host name in `Host`, so the open gateway answers only
Host headers naming it: the bound address, loopback names, or `allowed_hosts`.

HTML responses (the dashboard) get a strict Content-Security-Policy and may not be framed.
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.edge.limits import envelope_for
from gateway.errors import APIError, MisdirectedRequest, UnsupportedMediaType, send_error
from gateway.settings import Settings

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})  # "listen everywhere": never a Host a client sends
ANY_HOST = "*"
# Infrastructure reads these by service name (Prometheus scrapes `gateway:8000`); they hold only
# counters and a status, nothing a rebinding page could use against a tenant.
HOST_EXEMPT_PATHS = frozenset({"/health", "/metrics"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
JSON_MEDIA_TYPE = "application/json"

# The dashboard loads its script, style and icon from /static and talks to /v1 on the same origin.
DASHBOARD_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
                 "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
                 "frame-ancestors 'none'")
HTML_HEADERS = ((b"content-security-policy", DASHBOARD_CSP.encode()), (b"x-frame-options", b"DENY"),
                (b"referrer-policy", b"no-referrer"))
EVERY_RESPONSE_HEADERS = ((b"x-content-type-options", b"nosniff"),)


class BrowserGuard:
    """Pure ASGI middleware: JSON-only bodies on `/v1/`, the Host check on the open gateway, and
    security headers on the way out."""

    def __init__(self, app: ASGIApp, check_host: bool, allowed_hosts: tuple[str, ...] = (),
                 bound_host: str = "127.0.0.1") -> None:
        self.app = app
        self.check_host = check_host and ANY_HOST not in allowed_hosts
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts)
        self.bound_host = bound_host.lower().strip("[]")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self.refusal(scope)
        if error is not None:
            await send_error(send, error, EVERY_RESPONSE_HEADERS, body=envelope_for(scope["path"], error))
            return
        await self.app(scope, receive, _with_security_headers(send))

    def refusal(self, scope: Scope) -> APIError | None:
        """The error for a request a page could have forged, or None to serve it."""
        headers = _headers(scope)
        if self.check_host and scope["path"] not in HOST_EXEMPT_PATHS:
            host = headers.get(b"host")
            if host is not None and not self.host_allowed(host.decode("latin-1"), scope):
                shown = host.decode("latin-1")[:100]
                return MisdirectedRequest(
                    f"this gateway does not answer for Host '{shown}': add it to the 'allowed_hosts' "
                    "setting (or configure API keys)")
        needs_json = scope["path"].startswith("/v1/") and _needs_json(scope["method"], headers)
        if needs_json and not is_json_media_type(headers.get(b"content-type", b"")):
            return UnsupportedMediaType("the request body must be JSON: send 'Content-Type: application/json'")
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        if needs_json and encoding not in (b"", b"identity"):  # never decoded: it was read as broken text
            shown = encoding.decode("latin-1")[:40]
            return UnsupportedMediaType(f"a request body in content-encoding '{shown}' is not supported: send it "
                                        "uncompressed")
        return None

    def host_allowed(self, host: str, scope: Scope) -> bool:
        """True for the bound address or a loopback name with the server's port, or an allowed host."""
        name, port = split_host(host.lower())
        if host.lower() in self.allowed_hosts or name in self.allowed_hosts:
            return True
        server_name, server_port = scope.get("server") or (None, None)
        local = {self.bound_host, str(server_name or "").lower()} - WILDCARD_BINDS
        return name in LOOPBACK_NAMES | local and (server_port is None or port == server_port)


def install_browser_guard(app: Any, settings: Settings) -> None:
    """Add the guard as the outermost middleware of `app` (before the body is read or parsed).

    With API keys configured the Host header is not checked: a rebinding page cannot read or
    send the key (it lives in the client's code, not in a cookie the browser would attach)."""
    is_open = not settings.api_keys and settings.admin_key is None
    app.add_middleware(BrowserGuard, check_host=is_open, allowed_hosts=settings.allowed_hosts,
                       bound_host=settings.host)


def is_json_media_type(value: bytes) -> bool:
    """`application/json`, with or without parameters (`; charset=utf-8`), in any letter case."""
    media_type = value.decode("latin-1").split(";", 1)[0].strip().lower()
    return media_type == JSON_MEDIA_TYPE


def split_host(host: str) -> tuple[str, int | None]:
    """('name', port) from a Host header: `a.b:8000`, `[::1]:8000`, `localhost` (port 80)."""
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        name, _, port_text = host.partition(":") if host.count(":") == 1 else (host, "", "")
    if not port_text:
        return name, 80
    return (name, int(port_text)) if port_text.isdigit() else (name, None)


def _needs_json(method: str, headers: dict[bytes, bytes]) -> bool:
    """POST, PUT, PATCH always carry a body; DELETE only when it has one (`curl -X DELETE`
    sends none, and a page cannot send a DELETE cross-origin without a preflight anyway)."""
    if method in BODY_METHODS:
        return True
    has_body = headers.get(b"content-length", b"0") not in (b"", b"0") or b"transfer-encoding" in headers
    return method == "DELETE" and has_body


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {name.lower(): value for name, value in scope["headers"]}


def _with_security_headers(send: Send) -> Send:
    async def send_with_headers(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
            extra = EVERY_RESPONSE_HEADERS + (HTML_HEADERS if content_type.startswith(b"text/html") else ())
            present = {k.lower() for k, _ in headers}
            headers += [(k, v) for k, v in extra if k not in present]
            message = {**message, "headers": headers}
        await send(message)

    return send_with_headers
