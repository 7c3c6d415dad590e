"""The proxy relays only the headers its own API defines (issue 36): its own `Content-Type` (JSON,
or an event stream), never an upstream's; an upstream's error page that is not a JSON object is
the upstream's failure, a 502 in the API's own error envelope, not an HTML page passed on; and
`X-Toolkv-Cache` only with a value toolkv's API defines (a toolkv upstream's word on its cache)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.proxy.conftest import messages, proxy, tools_of
from tests.proxy.fake_upstream import RawUpstream

TOOLS = tools_of([("alpha", 5)])
HTML = b"<html><body><h1>404 Not Found</h1><script>alert(1)</script></body></html>"


def raw(status_line: bytes, content: bytes, content_type: bytes, *headers: bytes) -> bytes:
    extra = b"".join(header + b"\r\n" for header in headers)
    return (status_line + b"\r\ncontent-type: " + content_type + b"\r\n" + extra
            + b"content-length: %d\r\n\r\n%s" % (len(content), content))


def chat(live: Any, **extra: Any) -> httpx.Response:
    body = {"model": "m", "messages": messages("You relay.", "hi"), "tools": TOOLS, **extra}
    return httpx.post(live.api_url + "/chat/completions", json=body, timeout=60)


def anthropic(live: Any) -> httpx.Response:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(live.api_url + "/messages", json=body, timeout=60, headers={"anthropic-version": "2023-06-01"})


@pytest.mark.parametrize("status_line", [b"HTTP/1.1 404 Not Found", b"HTTP/1.1 413 Payload Too Large",
                                         b"HTTP/1.1 200 OK"])
def test_an_html_page_from_an_upstream_is_a_502_in_the_apis_envelope(status_line: bytes) -> None:
    """Passed on as sent, a 404 reached the client as `text/html` with the page's script."""
    with RawUpstream(raw(status_line, HTML, b"text/html")) as upstream, proxy([upstream]) as live:
        for stream in (False, True):
            resp = chat(live, stream=stream)
            assert resp.status_code == 502 and resp.headers["content-type"] == "application/json"
            error = resp.json()["error"]
            assert error["code"] == "upstream_error" and "not a JSON object" in error["message"]
            assert b"<script>" not in resp.content
        resp = anthropic(live)
        assert resp.status_code == 502 and resp.headers["content-type"] == "application/json"
        assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "api_error"


def test_the_content_type_is_the_proxys_own() -> None:
    """A JSON answer labelled `text/html` (a browser would render it) reaches the client as JSON."""
    answer = b'{"id": "x", "object": "chat.completion", "choices": [], "usage": null}'
    with RawUpstream(raw(b"HTTP/1.1 200 OK", answer, b"text/html; charset=utf-8")) as upstream, \
            proxy([upstream]) as live:
        resp = chat(live)
        assert resp.status_code == 200 and resp.content == answer
        assert resp.headers["content-type"] == "application/json"
    error = b'{"error": {"message": "bad", "type": "invalid_request_error", "param": null, "code": null}}'
    with RawUpstream(raw(b"HTTP/1.1 400 Bad Request", error, b"text/plain")) as upstream, proxy([upstream]) as live:
        resp = chat(live)
        assert resp.status_code == 400 and resp.content == error
        assert resp.headers["content-type"] == "application/json"


@pytest.mark.parametrize(("sent", "relayed"), [(b"hit", "hit"), (b"miss", "miss"), (b"bypass", "bypass"),
                                               (b"skip", "skip"), (b"HIT", None), (b"hit; evil=1", None),
                                               (b"<script>", None)])
def test_x_toolkv_cache_is_relayed_only_as_toolkv_defines_it(sent: bytes, relayed: str | None) -> None:
    answer = b'{"id": "x", "object": "chat.completion", "choices": []}'
    with RawUpstream(raw(b"HTTP/1.1 200 OK", answer, b"application/json", b"x-toolkv-cache: " + sent)) as upstream, \
            proxy([upstream]) as live:
        resp = chat(live)
        assert resp.status_code == 200 and resp.headers.get("x-toolkv-cache") == relayed
