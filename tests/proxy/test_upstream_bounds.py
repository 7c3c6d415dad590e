"""What an upstream sends is read bounded and passed on only as the proxy means to (issue 25,
items 2 and 7): a whole answer or one stream event over `upstream_max_body_bytes` is a 502 in the
error envelope (an error event mid-stream), a compressed answer is never decompressed, only
allow-listed headers and plain statuses reach the client, and a stream that sends keep-alive
comments alone is failed over before its first event and ended after it."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from tests.proxy.conftest import home_of, messages, proxy, tools_of
from tests.proxy.fake_upstream import RawUpstream

TOOLS = tools_of([("alpha", 5), ("bravo", 12)])
SYSTEM = "You are bounded."
CAP = 64 * 1024


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages(SYSTEM, "hi"), "tools": TOOLS, **extra}


def post(live: Any, payload: dict[str, Any]) -> httpx.Response:
    return httpx.post(live.api_url + "/chat/completions", json=payload, timeout=60)


def events(resp: httpx.Response) -> list[bytes]:
    return [line[6:] for line in resp.content.split(b"\n") if line.startswith(b"data: ")]


def assert_bad_gateway(resp: httpx.Response, says: str) -> None:
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]
    assert error["type"] == "server_error" and says in error["message"]


def test_an_upstream_answer_over_the_cap_is_a_502_never_read_whole(fakes):
    _arrivals, upstreams = fakes
    for fake in upstreams:
        fake.padding = 4 * CAP
    with proxy(upstreams, upstream_max_body_bytes=CAP) as live:
        assert_bad_gateway(post(live, body()), "over the limit")
        for fake in upstreams:
            fake.padding = CAP // 2
        assert post(live, body()).status_code == 200  # under it: passed on whole


def test_a_stream_event_over_the_cap_ends_the_stream_with_an_error_event(fakes):
    _arrivals, upstreams = fakes
    for fake in upstreams:
        fake.padding = 4 * CAP  # the content event; the role event before it is small
    with proxy(upstreams, upstream_max_body_bytes=CAP) as live:
        resp = post(live, body(stream=True))
        assert resp.status_code == 200
        sent = events(resp)
        assert orjson.loads(sent[-2])["error"]["code"] == "upstream_error" and sent[-1] == b"[DONE]"
        assert len(resp.content) < CAP


def test_a_compressed_answer_is_never_decompressed(fakes):
    arrivals, upstreams = fakes
    for fake in upstreams:  # a bomb: 40 MB of spaces in a ~40 KB gzip answer, although identity was asked
        fake.gzipped, fake.padding = True, 40 * 1024**2
    with proxy(upstreams, upstream_max_body_bytes=CAP) as live:
        assert_bad_gateway(post(live, body()), "content-encoding 'gzip'")
    assert {a.headers["accept-encoding"] for a in arrivals.seen} == {"identity"}


def test_only_the_headers_toolkv_means_to_send_reach_clients(fakes):
    _arrivals, upstreams = fakes
    foreign = {"set-cookie": "session=upstream", "access-control-allow-origin": "*",
               "access-control-allow-credentials": "true", "location": "http://elsewhere.example/",
               "refresh": "0; url=http://elsewhere.example/", "x-powered-by": "fake", "server": "fake-upstream"}
    for fake in upstreams:
        fake.extra_headers = {**foreign, "x-toolkv-cache": "hit", "x-ratelimit-remaining-requests": "9"}
    with proxy(upstreams) as live:
        for stream in (False, True):
            resp = post(live, body(stream=stream))
            assert resp.status_code == 200
            assert not set(foreign) & {name.lower() for name in resp.headers if name.lower() != "server"}
            assert resp.headers.get("server") != "fake-upstream"
            assert resp.headers["x-toolkv-cache"] == "hit" and resp.headers["x-ratelimit-remaining-requests"] == "9"


def test_a_cookie_an_upstream_sets_is_never_sent_again(fakes):
    """The proxy's client is shared by every tenant: a kept upstream cookie (a balancer's session)
    would go out on every other client's requests."""
    arrivals, upstreams = fakes
    for fake in upstreams:
        fake.extra_headers = {"set-cookie": "session=upstream; Path=/"}
    with proxy(upstreams) as live:
        for stream in (False, True, False):
            assert post(live, body(stream=stream)).status_code == 200
    assert len(arrivals.seen) == 3 and not [a for a in arrivals.seen if "cookie" in a.headers]


def test_a_redirect_or_a_strange_status_from_an_upstream_is_its_failure(fakes):
    _arrivals, upstreams = fakes
    for status in (302, 307):
        for fake in upstreams:
            fake.status, fake.extra_headers = status, {"location": "http://elsewhere.example/"}
        with proxy(upstreams) as live:
            resp = post(live, body())
            assert_bad_gateway(resp, f"status {status}")
            assert "location" not in resp.headers
    content = b'{"id":"x","object":"chat.completion","choices":[]}'
    for status_line in (b"HTTP/1.1 600 Whatever", b"HTTP/1.1 200 OK<script>alert(1)</script>"):
        answer = (status_line + b"\r\ncontent-type: application/json\r\nset-cookie: s=1\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(content), content))
        with RawUpstream(answer) as raw, proxy([raw]) as live:
            resp = httpx.post(live.api_url + "/chat/completions", json=body(), timeout=60)
            assert "set-cookie" not in resp.headers
            if b" 600 " in status_line:
                assert_bad_gateway(resp, "status 600")
            else:
                assert resp.status_code == 200 and resp.content == content
                assert resp.reason_phrase == "OK"  # the proxy's own status line, never the upstream's


def test_an_upstream_sending_only_keep_alive_comments_is_failed_over(fakes):
    arrivals, upstreams = fakes
    home = home_of(upstreams, SYSTEM, TOOLS)
    home.comments_after = 0
    with proxy(upstreams, upstream_event_timeout_s=0.5) as live:
        resp = post(live, body(stream=True))
        assert resp.status_code == 200
        assert orjson.loads(events(resp)[1])["choices"][0]["delta"]["content"].startswith("from ")
        assert [a.upstream for a in arrivals.seen] == [home.name, next(u for u in upstreams if u is not home).name]
        for fake in upstreams:
            fake.comments_after = 0
        assert_bad_gateway(post(live, body(stream=True)), "no data event within 0.5 s")


def test_a_stream_that_goes_quiet_but_for_comments_is_ended(fakes):
    arrivals, upstreams = fakes
    for fake in upstreams:
        fake.comments_after = 2  # the role and content events, then comments alone
    with proxy(upstreams, upstream_event_timeout_s=0.5) as live:
        resp = post(live, body(stream=True))
        assert resp.status_code == 200
        sent = events(resp)
        assert orjson.loads(sent[1])["choices"][0]["delta"]["content"] == "from " + arrivals.seen[0].upstream
        assert orjson.loads(sent[-2])["error"]["code"] == "upstream_error" and sent[-1] == b"[DONE]"
        assert b": still here" in resp.content  # the comments went on to the client as they came


def raw_answer(status_line: bytes, content: bytes, content_type: bytes = b"application/json") -> bytes:
    return (status_line + b"\r\ncontent-type: " + content_type + b"\r\ncontent-length: %d\r\n\r\n%s"
            % (len(content), content))


@pytest.mark.parametrize(("answer", "says"), [
    (raw_answer(b"HTTP/1.1 200 OK", b"<html>not json</html>", b"text/html"), "not a JSON object"),
    (raw_answer(b"HTTP/1.1 200 OK", b'{"choices": [1,2'), "not a JSON object"),
    (raw_answer(b"HTTP/1.1 200 OK", b"[1,2,3]"), "not a JSON object"),
    (raw_answer(b"HTTP/1.1 204 No Content", b""), "status 204"),
    (raw_answer(b"HTTP/1.1 299 Odd", b"{}"), "status 299"),
    (b"HELLO WORLD\r\n\r\n", "a malformed HTTP answer"),
])
def test_an_answer_that_is_not_an_openai_answer_is_the_upstreams_failure(answer, says):
    """Relayed as sent, each reached the client as a 200 (or a 204, a 299); a status line that is
    not HTTP was a 503 "not reachable" that quoted its bytes."""
    with RawUpstream(answer) as raw, proxy([raw]) as live:
        for stream in (False, True):
            resp = post(live, body(stream=stream))
            assert_bad_gateway(resp, says)
            assert "HELLO" not in resp.text and "html" not in resp.text


def test_the_proxys_upstream_key_quoted_back_in_an_error_is_hidden():
    key = "sk-upstream-SUPERSECRET123"
    answer = raw_answer(b"HTTP/1.1 401 Unauthorized", b'{"error": {"message": "bad key Bearer %s"}}' % key.encode())
    with RawUpstream(answer) as raw, proxy([raw], upstream_api_key=key) as live:
        resp = post(live, body())
    assert resp.status_code == 401 and key not in resp.text
    assert resp.json()["error"]["message"] == "bad key Bearer <hidden>"


def test_a_stream_closed_before_its_last_event_ends_with_an_error_event():
    """A close-delimited stream (no length, not chunked) that stops early looks like a clean end to
    HTTP: without its `[DONE]` the client gets the upstream_error event, not a short answer that
    reads as whole; with it the stream passes as sent."""
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "finish_reason": None}]}
    cut = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
           b"data: " + orjson.dumps(chunk) + b"\n\n")
    with RawUpstream(cut) as raw, proxy([raw]) as live:
        sent = events(post(live, body(stream=True)))
    assert orjson.loads(sent[0])["choices"][0]["delta"]["content"] == "Hel"
    assert orjson.loads(sent[-2])["error"]["code"] == "upstream_error" and sent[-1] == b"[DONE]"
    for ending in (b"data: [DONE]\n\n", b"data: [DONE]"):  # the last event's blank line may be cut
        with RawUpstream(cut + ending) as raw, proxy([raw]) as live:
            resp = post(live, body(stream=True))
        assert resp.status_code == 200 and b"upstream_error" not in resp.content
        assert events(resp)[-1] == b"[DONE]"
