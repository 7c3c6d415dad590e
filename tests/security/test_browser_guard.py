"""What a web page in the user's browser can make it send to a gateway on 127.0.0.1, through a
real server: a cross-origin form POST (no preflight), DNS rebinding (a foreign Host), framing the
dashboard, and CDN assets."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.api.app import create_app
from gateway.edge.handlers import install_browser_guard, split_host
from gateway.settings import load_settings
from tests.observability.test_dashboard_browser import Page, browser  # noqa: F401 - the fixture
from tests.support.server import LiveServer, serve_app

KEY = "browser-test-key"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]
CHAT = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, "max_tokens": 2,
        "temperature": 0}


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Callable[..., Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LiveServer]]:
    """gateway(**settings): a server with the browser guard installed, one per set of settings."""
    running: dict[str, LiveServer] = {}
    with ExitStack() as stack:
        def start(**overrides: Any) -> LiveServer:
            name = json.dumps(overrides, sort_keys=True)
            if name not in running:
                settings = load_settings(overrides={
                    "model": str(tiny_model_dir()), "cache_dir": str(tmp_path_factory.mktemp("cache")),
                    "min_prefix_tokens": 8, "default_max_tokens": 4, **overrides}, environ={})
                app = create_app(settings)
                install_browser_guard(app, settings)
                running[name] = stack.enter_context(serve_app(app))
            return running[name]

        yield start


def port_of(live: LiveServer) -> int:
    return int(live.base_url.rsplit(":", 1)[1])


def lookups(live: LiveServer) -> list[str]:
    metrics = httpx.get(live.base_url + "/metrics").text.splitlines()
    return [line for line in metrics if line.startswith("toolkv_cache_lookups_total")]


def assert_envelope(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["code"] == code


# ---- JSON bodies only (CSRF without a preflight) ------------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_body_that_is_not_declared_json_is_refused_before_it_runs(
        gateway: Callable[..., LiveServer], content_type: str | None) -> None:
    live = gateway()
    headers = {"Content-Type": content_type} if content_type else {}
    before = lookups(live)
    for path in ("/chat/completions", "/cache/warm"):
        resp = httpx.post(live.api_url + path, content=json.dumps(CHAT), headers=headers, timeout=60)
        assert_envelope(resp, 415, "unsupported_media_type")
    assert lookups(live) == before  # nothing reached the model


def test_a_compressed_body_is_refused_not_read_as_broken_text(gateway: Callable[..., LiveServer]) -> None:
    """A gzip body was read as text (a 400 about UTF-8), a plain one labelled gzip was served."""
    live = gateway()
    for body in (gzip.compress(json.dumps(CHAT).encode()), json.dumps(CHAT).encode()):
        resp = httpx.post(live.api_url + "/chat/completions", content=body, timeout=60,
                          headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        assert_envelope(resp, 415, "unsupported_media_type")
        assert "content-encoding 'gzip'" in resp.json()["error"]["message"]
    plain = httpx.post(live.api_url + "/chat/completions", content=json.dumps(CHAT), timeout=60,
                       headers={"Content-Type": "application/json", "Content-Encoding": "identity"})
    assert plain.status_code == 200, plain.text


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8"])
def test_json_bodies_are_served(gateway: Callable[..., LiveServer], content_type: str) -> None:
    live = gateway()
    resp = httpx.post(live.api_url + "/chat/completions", content=json.dumps(CHAT),
                      headers={"Content-Type": content_type}, timeout=60)
    assert resp.status_code == 200, resp.text


def test_a_delete_without_a_body_needs_no_content_type(gateway: Callable[..., LiveServer]) -> None:
    resp = httpx.delete(gateway().api_url + "/cache", timeout=60)  # `curl -X DELETE` sends no Content-Type
    assert resp.status_code == 200, resp.text


# ---- Host on the open gateway (DNS rebinding) ---------------------------------------------------


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "localhost:1", "127.0.0.1.nip.io:{port}",
                                  "127.0.0.1:{port}@evil.example", "[::1]:1"])
def test_the_open_gateway_refuses_a_foreign_host(gateway: Callable[..., LiveServer], host: str) -> None:
    live = gateway()
    headers = {"Host": host.format(port=port_of(live))}
    for path in ("/v1/cache", "/v1/models", "/v1/dashboard/stats", "/"):
        assert_envelope(httpx.get(live.base_url + path, headers=headers), 421, "invalid_host")
    resp = httpx.post(live.api_url + "/chat/completions", json=CHAT, headers=headers, timeout=60)
    assert_envelope(resp, 421, "invalid_host")


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST:{port}", "[::1]:{port}"])
def test_the_open_gateway_serves_its_own_address_and_loopback_names(
        gateway: Callable[..., LiveServer], host: str) -> None:
    live = gateway()
    resp = httpx.get(live.api_url + "/cache", headers={"Host": host.format(port=port_of(live))})
    assert resp.status_code == 200, resp.text


def test_health_and_metrics_answer_any_host(gateway: Callable[..., LiveServer]) -> None:
    live = gateway()  # Prometheus scrapes by service name (`gateway:8000`): only counters there
    for path in ("/health", "/metrics"):
        assert httpx.get(live.base_url + path, headers={"Host": "gateway:8000"}).status_code == 200


def test_allowed_hosts_are_served(gateway: Callable[..., LiveServer]) -> None:
    live = gateway(allowed_hosts=("api.internal", "proxy.internal:8443"))
    for host in ("api.internal", "api.internal:9999", "proxy.internal:8443"):
        assert httpx.get(live.api_url + "/cache", headers={"Host": host}).status_code == 200, host
    assert_envelope(httpx.get(live.api_url + "/cache", headers={"Host": "proxy.internal:80"}), 421, "invalid_host")
    assert httpx.get(gateway(allowed_hosts=("*",)).api_url + "/cache", headers={"Host": "x.y"}).status_code == 200


def test_with_api_keys_the_host_is_not_checked(gateway: Callable[..., LiveServer]) -> None:
    # a rebinding page cannot send the key (a client's code holds it, not a cookie)
    live = gateway(api_keys=(KEY,))
    headers = {"Host": "evil.example", "Authorization": f"Bearer {KEY}"}
    resp = httpx.post(live.api_url + "/chat/completions", json=CHAT, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    keyless = httpx.post(live.api_url + "/chat/completions", json=CHAT, headers={"Host": "evil.example"})
    assert keyless.status_code == 401


def test_host_headers_split_into_name_and_port() -> None:
    assert split_host("localhost:8000") == ("localhost", 8000)
    assert split_host("[::1]:8000") == ("::1", 8000)
    assert split_host("[::1]") == ("::1", 80)
    assert split_host("example.com") == ("example.com", 80)
    assert split_host("a:b") == ("a", None)


# ---- the dashboard cannot be framed or injected into; nothing from a CDN ------------------------


def test_the_dashboard_has_a_strict_csp_and_refuses_framing(gateway: Callable[..., LiveServer]) -> None:
    resp = httpx.get(gateway().base_url + "/")
    assert resp.status_code == 200
    csp = {d.split()[0]: d.split()[1:] for d in resp.headers["content-security-policy"].split("; ")}
    assert csp["default-src"] == ["'self'"] and csp["script-src"] == ["'self'"]
    assert csp["frame-ancestors"] == ["'none'"] and csp["object-src"] == ["'none'"]
    assert "unsafe-inline" not in resp.headers["content-security-policy"]
    assert resp.headers["x-frame-options"] == "DENY"
    assert resp.headers["x-content-type-options"] == "nosniff"
    assert resp.headers["referrer-policy"] == "no-referrer"
    assert "<script>" not in resp.text and " style=" not in resp.text  # the CSP would block both


def test_no_page_loads_assets_from_a_cdn(gateway: Callable[..., LiveServer]) -> None:
    live = gateway()
    for path in ("/docs", "/redoc"):  # FastAPI's pages pull Swagger UI / ReDoc from jsdelivr
        assert httpx.get(live.base_url + path).status_code == 404, path
    assert httpx.get(live.base_url + "/openapi.json").status_code == 200
    page = httpx.get(live.base_url + "/").text
    assert "http://" not in page and "https://" not in page and "//cdn" not in page


def test_the_dashboard_works_under_its_csp_in_a_real_browser(
        browser: Any, gateway: Callable[..., LiveServer]) -> None:  # noqa: F811 - the imported fixture
    live = gateway(default_max_tokens=8)
    browser.get(live.base_url + "/")
    page = Page(browser)
    page.wait_for(lambda: page.attr("status", "data-status") == "ok")  # its script ran and fetched
    assert browser.execute_script("return document.styleSheets[0].cssRules.length") > 0  # its CSS loaded
    page.set_value("play-max-tokens", "4")
    page.send()
    page.send()
    assert page.badge("run-cache") == "hit"
    page.wait_for(lambda: int(page.attr("ttft-chart", "data-points")) >= 1)  # the SVG chart drew
