"""`toolkv serve --upstream`: settings that fail loudly naming the key, and a real `toolkv serve`
process in proxy mode that never imports torch and serves a chat through its upstream."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from gateway.cli.main import main
from gateway.settings import SettingsError, load_settings
from tests.proxy.conftest import running
from tests.proxy.fake_upstream import Arrivals, FakeUpstream
from tests.support.server import free_port, wait_until_ready


def test_upstream_urls_are_normalised_from_the_environment():
    settings = load_settings(environ={"TOOLKV_UPSTREAMS": "http://a:8000/v1/, https://b.example/base/"})
    assert settings.upstreams == ("http://a:8000", "https://b.example/base")


@pytest.mark.parametrize("url, words", [("ftp://a", "not an http(s) URL"), ("http://a:port", "bad port"),
                                        ("http://user:pw@a", "base URL alone"), ("http://a,http://a/v1", "twice")])
def test_a_bad_upstream_stops_start_up_naming_it(url, words, capsys):
    assert main(["serve", "--upstream", url]) == 2
    err = capsys.readouterr().err
    assert "upstreams" in err and words in err


def test_the_upstream_key_is_hidden_in_errors(tmp_path):
    config = tmp_path / "proxy.toml"
    config.write_text("upstream_api_key = 31415926\n")
    with pytest.raises(SettingsError) as exc:
        load_settings(config, environ={})
    assert "upstream_api_key" in str(exc.value) and "<hidden>" in str(exc.value)
    assert "31415926" not in str(exc.value)


def test_a_bad_cache_salt_mode_is_named():
    with pytest.raises(SettingsError, match="upstream_cache_salt"):
        load_settings(environ={"TOOLKV_UPSTREAM_CACHE_SALT": "sometimes"})


def test_proxy_mode_builds_without_importing_torch():
    code = ("import sys; from gateway.cli.main import _app; from gateway.settings import load_settings; "
            "_app(load_settings(overrides={'upstreams': ('http://127.0.0.1:9',)}, environ={})); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=_env())


def test_toolkv_serve_upstream_runs_a_proxy_process():
    fake = FakeUpstream("a", Arrivals())
    with running(fake.app) as upstream:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port),
                                 "--upstream", upstream.base_url], env=_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            base = f"http://127.0.0.1:{port}"
            health = wait_until_ready(base, deadline_s=120)
            assert health["status"] == "ok" and health["upstreams"][0]["url"] == upstream.base_url
            resp = httpx.post(base + "/v1/chat/completions", timeout=30,
                              json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert resp.json()["choices"][0]["message"]["content"] == "from a"
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        assert proc.returncode in (0, -signal.SIGTERM), err.decode()  # uvicorn re-raises the signal it drained on
        assert b"proxy mode: forwarding to " + upstream.base_url.encode() in err
        assert b"request done" in err and b"HTTP Request:" not in err  # one line per request: the proxy's


def _env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("TOOLKV_")},
            "PYTHONPATH": os.pathsep.join(sys.path)}
