"""Hostile or careless clients against a real server with API keys: slow senders, callers without a
key, one key hogging the engine, clients that hang up, and bugs; none of them costs another
tenant anything, and every outcome is counted."""

from __future__ import annotations

import json
import logging
import socket

import httpx
import pytest

from gateway.settings import load_settings
from tests.support.server import serve
from tests.support.waiting import wait_until

KEYS = ("key-alpha-123", "key-beta-456")
LONG = {"messages": [{"role": "user", "content": "Count forever"}], "max_tokens": 3000, "temperature": 0}
HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory):
    settings = load_settings(overrides={
        "model": str(tiny_model_dir("llama")), "min_prefix_tokens": 8, "api_keys": KEYS,
        "cache_dir": str(tmp_path_factory.mktemp("cache")), "max_requests_per_key": 2,
        "header_read_timeout_s": 1.0, "body_read_timeout_s": 1.0}, environ={})
    with serve(settings) as server:
        yield server


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def requests_counted(live, status: str, stream: str) -> float:
    metric = live.app.state.gateway.metrics.requests.labels(status=status, stream=stream)
    return float(metric._value.get())


def raw_request(live, head: bytes, body: bytes = b"", read_timeout_s: float = 15.0) -> bytes:
    port = int(live.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout_s) as sock:
        sock.sendall(head + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks) and b'"error"' in b"".join(chunks):
                break
        return b"".join(chunks)


def test_the_key_is_checked_before_the_body_is_read(live):
    """A caller without a valid key gets 401 at once, although its declared body never arrives."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer wrong\r\nContent-Length: 1000000\r\n\r\n")
    reply = raw_request(live, head)
    assert reply.startswith(b"HTTP/1.1 401"), reply[:100]
    assert b"invalid_api_key" in reply


def test_a_body_that_trickles_in_gets_408(live):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEYS[0]}\r\nContent-Length: 1000\r\n\r\n".encode())
    reply = raw_request(live, head, b'{"messages": [')
    assert reply.startswith(b"HTTP/1.1 408"), reply[:100]
    assert b"request_timeout" in reply


def test_headers_that_never_finish_get_the_connection_closed(live):
    port = int(live.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        assert sock.recv(65536) == b""  # closed by the server after header_read_timeout_s
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:  # connects and sends nothing
        assert sock.recv(65536) == b""
    assert httpx.get(live.base_url + "/health").status_code == 200


def open_request(live, payload: dict, key: str) -> socket.socket:
    """Send a chat request on a raw connection and leave it waiting (closing it hangs up)."""
    port = int(live.base_url.rsplit(":", 1)[1])
    body = json.dumps(payload).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n"
                 + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def test_one_key_cannot_hold_more_than_its_quota_and_others_still_get_served(live):
    quota, salt = live.app.state.gateway.quota, _salt(live, KEYS[0])
    held = [open_request(live, LONG, KEYS[0]), open_request(live, dict(LONG, stream=True), KEYS[0])]
    try:
        assert wait_until(lambda: quota.held(salt) == 2)  # one running, one queued behind it
        third = httpx.post(live.api_url + "/chat/completions", json=HI, headers=auth(KEYS[0]), timeout=60)
        assert third.status_code == 429
        assert third.headers["retry-after"]
        assert third.json()["error"]["type"] == "rate_limit_error"
    finally:
        for sock in held:  # hang up: both are cancelled, queued or running, and give their slots back
            sock.close()
    other = httpx.post(live.api_url + "/chat/completions", json=HI, headers=auth(KEYS[1]), timeout=120)
    assert other.status_code == 200
    assert wait_until(lambda: quota.held(salt) == 0)
    again = httpx.post(live.api_url + "/chat/completions", json=HI, headers=auth(KEYS[0]), timeout=120)
    assert again.status_code == 200


def _salt(live, key: str) -> str:
    from gateway.edge.admission import _salt

    return _salt(key.encode())


def test_a_non_streaming_client_that_hangs_up_cancels_its_generation(live, caplog):
    engine = live.app.state.gateway.model.runtime.engine
    cancelled_before = engine.num_cancelled
    hangups_before = requests_counted(live, "499", "false")
    ok_before = requests_counted(live, "200", "false")
    caplog.set_level(logging.INFO, logger="gateway.serving.service")  # the server logs the 499 after the hang-up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.api_url + "/chat/completions", json=LONG, headers=auth(KEYS[0]), timeout=1.5)
    assert wait_until(lambda: requests_counted(live, "499", "false") == hangups_before + 1)
    assert wait_until(lambda: engine.num_cancelled == cancelled_before + 1)
    assert requests_counted(live, "200", "false") == ok_before  # not logged or counted as a success
    statuses = [r.toolkv.get("status") for r in caplog.records if hasattr(r, "toolkv")]
    assert "499" in statuses and "200" not in statuses
    after = httpx.post(live.api_url + "/chat/completions", json=HI, headers=auth(KEYS[1]), timeout=60)
    assert after.status_code == 200  # the engine is free: the hung-up generation did not run on


def test_a_streaming_client_that_hangs_up_is_counted_as_499(live):
    before = requests_counted(live, "499", "true")
    with httpx.stream("POST", live.api_url + "/chat/completions", json=dict(LONG, stream=True),
                      headers=auth(KEYS[0]), timeout=60) as resp:
        next(line for line in resp.iter_lines() if line.startswith("data: "))
    assert wait_until(lambda: requests_counted(live, "499", "true") == before + 1)


def test_an_unexpected_error_is_a_counted_500_logged_with_its_request_id(live, caplog):
    service = live.app.state.gateway.model.runtime.service
    real = service.prepare

    def broken(*args, **kwargs):  # fault injection: a bug in preparing
        raise RuntimeError("simulated bug /secret/path")

    before = requests_counted(live, "500", "unknown")
    service.prepare = broken
    try:
        with caplog.at_level(logging.ERROR, logger="gateway.api.app"):
            resp = httpx.post(live.api_url + "/chat/completions", json=HI, headers=auth(KEYS[0]), timeout=60)
    finally:
        service.prepare = real
    assert resp.status_code == 500
    assert resp.json()["error"] == {"message": "internal server error", "type": "server_error",
                                    "param": None, "code": None}
    assert "/secret/path" not in resp.text
    assert requests_counted(live, "500", "unknown") == before + 1
    logged = [r for r in caplog.records if getattr(r, "toolkv", {}).get("status") == 500]
    assert logged and logged[0].toolkv["request_id"].startswith("chatcmpl-")


def test_one_tenant_cannot_time_another_tenants_system_prompt_and_tools(live, merchant_tools):
    """The tokenizer's remembered group heads (what makes a known group's prepare faster, visible in
    Server-Timing and in how fast a 400 comes back) are per tenant: B's first sight of a group A sent
    is as slow as if nobody had sent it. A rejected request (max_tokens over the context) leaves
    nothing behind either."""
    tokens = live.app.state.gateway.model.runtime.service.prompt_tokens
    body = {"messages": [{"role": "system", "content": "Tenant A's secret prompt."},
                         {"role": "user", "content": "hi"}],
            "tools": merchant_tools[:3], "tool_choice": "none", "max_tokens": 2, "temperature": 0}
    salt_a, salt_b = _salt(live, KEYS[0]), _salt(live, KEYS[1])
    ok = httpx.post(live.api_url + "/chat/completions", json=body, headers=auth(KEYS[0]), timeout=60)
    assert ok.status_code == 200
    assert len(tokens.remembered(salt_a)) == 1
    assert tokens.remembered(salt_b) == []
    split_before = tokens.split_uses
    probe = httpx.post(live.api_url + "/chat/completions", json=dict(body, max_tokens=10**6),
                       headers=auth(KEYS[1]), timeout=60)
    assert probe.status_code == 400 and probe.json()["error"]["code"] == "context_length_exceeded"
    assert tokens.split_uses == split_before  # B's probe did not take A's fast path
    assert tokens.remembered(salt_b) == []  # and, rejected, it left nothing behind
    again = httpx.post(live.api_url + "/chat/completions", json=body, headers=auth(KEYS[0]), timeout=60)
    assert again.status_code == 200 and tokens.split_uses == split_before + 1  # A's own fast path
