"""Real gateway processes on one cache dir: a restart serves the first request from disk with the
same output; damaged files after a restart are recomputed and counted; the `toolkv cache` CLI
works on the dir without a server, and a server (in this process) then hits what it warmed."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.kvcache.disk_tier import DiskTier
from gateway.settings import load_settings
from tests.support.cache_cli import cache_cli
from tests.support.server import free_port, serve
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
READY_DEADLINE_S = 180.0
SYSTEM = "You are the back-office assistant of a small web shop. Be brief."
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')} for a customer",
                                      "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                                                     "required": ["order_id"]}}}
    for name in ("get_order", "cancel_order", "refund_order", "track_parcel")
]
# Three tool groups; after the first run, two of their files get damaged.
GROUPS = {"intact": TOOLS, "flipped": TOOLS[:2], "truncated": TOOLS[:3]}


def chat_body(group: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is order 42?"}],
            "tools": GROUPS[group], "temperature": 0, "max_tokens": 16}


@dataclass
class Gateway:
    base_url: str
    log_path: Path

    def chat(self, group: str = "intact") -> dict[str, Any]:
        resp = httpx.post(self.base_url + "/v1/chat/completions", json=chat_body(group), timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()  # type: ignore[no-any-return]

    def metrics(self) -> str:
        return httpx.get(self.base_url + "/metrics", timeout=30).text

    @property
    def log(self) -> str:
        return self.log_path.read_text()


def _env(model_dir: Path, cache_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLKV_")}
    return {**env, "TOOLKV_MODEL": str(model_dir), "TOOLKV_CACHE_DIR": str(cache_dir),
            "TOOLKV_MIN_PREFIX_TOKENS": "8", "HF_HUB_OFFLINE": "1"}


@contextmanager
def gateway_process(model_dir: Path, cache_dir: Path, log_path: Path) -> Iterator[Gateway]:
    """`toolkv serve` in its own process; stopped with SIGTERM, as a service manager would."""
    port = free_port()
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)], cwd=ROOT,
                                env=_env(model_dir, cache_dir), stdout=log, stderr=subprocess.STDOUT)
    gateway = Gateway(f"http://127.0.0.1:{port}", log_path)
    try:
        _wait_ready(proc, gateway)
        yield gateway
    finally:
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully (lifespan included), then re-raises the signal
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM), gateway.log
        assert "Application shutdown complete" in gateway.log


def _wait_ready(proc: subprocess.Popen[bytes], gateway: Gateway) -> None:
    """Readiness polling of /health with a deadline (not synchronisation by sleep)."""
    def ready() -> bool:
        assert proc.poll() is None, f"gateway exited:\n{gateway.log}"
        try:
            return bool(httpx.get(gateway.base_url + "/health", timeout=5).json().get("status") == "ok")
        except httpx.HTTPError:
            return False

    if not wait_until(ready, READY_DEADLINE_S, interval_s=0.1):
        raise TimeoutError(f"gateway not ready:\n{gateway.log}")


def _cached_tokens(completion: dict[str, Any]) -> int:
    return int(completion["usage"]["prompt_tokens_details"]["cached_tokens"])


def _message(completion: dict[str, Any]) -> dict[str, Any]:
    return completion["choices"][0]["message"]  # type: ignore[no-any-return]


@dataclass(frozen=True)
class FirstRun:
    cache_dir: Path
    completions: dict[str, dict[str, Any]]  # by group
    entries: dict[str, dict[str, Any]]  # by group, as GET /v1/cache listed them

    def entry_file(self, cache_dir: Path, group: str) -> Path:
        return cache_dir / "kv" / f"{self.entries[group]['id']}.safetensors"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def first_run(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> FirstRun:
    """One gateway that served one chat request per tool group (misses), then was stopped. Run
    once per test process (a gateway process costs ~15 s): test_hostile_cache_dir.py uses it too,
    and every user copies its cache dir before changing anything."""
    return _first_run(model_dir, tmp_path_factory.getbasetemp())


@functools.cache
def _first_run(model_dir: Path, base_temp: Path) -> FirstRun:
    work = base_temp / "first-run"
    work.mkdir()
    with gateway_process(model_dir, work / "cache", work / "gateway.log") as gateway:
        completions = {group: gateway.chat(group) for group in GROUPS}
        listed = httpx.get(gateway.base_url + "/v1/cache").json()["data"]
    entries = {group: next(e for e in listed if len(e["tool_names"]) == len(tools)) for group, tools in GROUPS.items()}
    # misses: none had its whole group cached (a group may start from another's common prefix)
    assert all(_cached_tokens(completions[g]) < entries[g]["prefix_tokens"] for g in GROUPS)
    return FirstRun(work / "cache", completions, entries)


def _copy_cache(first_run: FirstRun, target: Path) -> Path:
    shutil.copytree(first_run.cache_dir, target)
    return target


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@dataclass(frozen=True)
class Restart:
    cache_dir: Path
    completions: dict[str, dict[str, Any]]  # by group, in the order sent: intact first
    metrics: str
    log: str


@pytest.fixture(scope="module")
def restart(first_run: FirstRun, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Restart:
    """A second gateway on a copy of the first one's cache dir, two of whose files were damaged."""
    work = tmp_path_factory.mktemp("restart")
    cache_dir = _copy_cache(first_run, work / "cache")
    _flip_a_byte(first_run.entry_file(cache_dir, "flipped"))
    _truncate(first_run.entry_file(cache_dir, "truncated"))
    with gateway_process(model_dir, cache_dir, work / "gateway.log") as gateway:
        completions = {group: gateway.chat(group) for group in GROUPS}
        metrics = gateway.metrics()
    return Restart(cache_dir, completions, metrics, gateway.log)


def test_after_a_restart_the_first_request_is_a_disk_hit_with_the_same_output(
        first_run: FirstRun, restart: Restart) -> None:
    completion = restart.completions["intact"]
    assert _cached_tokens(completion) == first_run.entries["intact"]["prefix_tokens"] > 8
    assert _message(completion) == _message(first_run.completions["intact"])
    assert 'toolkv_cache_lookups_total{result="hit",tier="disk"} 1.0' in restart.metrics


def test_damaged_files_after_a_restart_are_recomputed_and_counted(first_run: FirstRun, restart: Restart) -> None:
    for group in ("flipped", "truncated"):
        # its file was not used (the group may start from the intact group's common prefix)
        assert _cached_tokens(restart.completions[group]) < first_run.entries[group]["prefix_tokens"]
        assert _message(restart.completions[group]) == _message(first_run.completions[group])
    errors = sorted(line for line in restart.metrics.splitlines() if line.startswith("toolkv_cache_errors_total{"))
    assert errors == ['toolkv_cache_errors_total{kind="checksum"} 1.0',
                      'toolkv_cache_errors_total{kind="corrupt"} 1.0']
    assert restart.log.count("disk cache entry rejected, recomputing") == 2
    moved = sorted(p.name.split(".")[:2] for p in (restart.cache_dir / "quarantine").iterdir())
    assert moved == sorted([[first_run.entries["flipped"]["id"], "checksum"],
                            [first_run.entries["truncated"]["id"], "corrupt"]])
    # the damaged files were moved aside; the recomputed entries were written in their place
    on_disk = {r.digest for r in DiskTier(restart.cache_dir, 1 << 30).records()}
    assert on_disk == {e["id"] for e in first_run.entries.values()}


@pytest.fixture
def cli(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> Iterator[Callable[..., tuple[int, str, str]]]:
    """`toolkv cache ...` through the real CLI entry point, in this process (no server)."""
    yield from cache_cli(model_dir, monkeypatch, capsys)


def test_cli_warms_lists_and_removes_entries_without_a_server(
        cli: Callable[..., tuple[int, str, str]], model_dir: Path, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    at = ("--cache-dir", str(cache_dir))
    group_file = tmp_path / "group.json"
    group_file.write_text(json.dumps({"system": SYSTEM, "tools": TOOLS}))
    code, out, err = cli("warm", str(group_file), *at)
    assert code == 0, err
    warmed = json.loads(out)
    assert warmed["on_disk"] is True and warmed["already_cached"] is False

    code, out, _ = cli("ls", "--json", *at)
    assert [(e["id"], e["prefix_tokens"], e["tool_names"]) for e in json.loads(out)] == [
        (warmed["id"], warmed["prefix_tokens"], ["cancel_order", "refund_order", "track_parcel", "get_order"])]
    code, out, _ = cli("ls", *at)  # tools in canonical order: largest schema first, then by name
    assert code == 0 and warmed["id"] in out and "cancel_order,refund_order" in out

    # a server on the dir hits what the CLI warmed (in this process: the tests above cross processes)
    settings = load_settings(overrides={"model": str(model_dir), "cache_dir": str(cache_dir), "min_prefix_tokens": 8},
                             environ={})
    with serve(settings) as live:
        resp = httpx.post(live.base_url + "/v1/chat/completions", json=chat_body("intact"), timeout=120)
        assert resp.status_code == 200 and _cached_tokens(resp.json()) == warmed["prefix_tokens"], resp.text
        assert 'toolkv_cache_lookups_total{result="hit",tier="disk"} 1.0' in httpx.get(live.base_url + "/metrics").text

    assert cli("rm", "../" + warmed["id"], *at)[0] == 2
    assert cli("rm", warmed["id"], *at)[:2] == (0, f"removed {warmed['id']}\n")
    code, _, err = cli("rm", warmed["id"], *at)
    assert code == 1 and "no entry" in err
    assert json.loads(cli("ls", "--json", *at)[1]) == []


def test_cli_warm_reports_a_group_it_cannot_cache(cli: Callable[..., tuple[int, str, str]], tmp_path: Path) -> None:
    group_file = tmp_path / "group.json"
    group_file.write_text(json.dumps({"system": "Hi"}))
    code, _, err = cli("warm", str(group_file), "--cache-dir", str(tmp_path / "cache"))
    assert code == 1 and "min_prefix_tokens (8)" in err
    group_file.write_text("[{\"type\": \"function\"}]")
    code, _, err = cli("warm", str(group_file), "--cache-dir", str(tmp_path / "cache"))
    assert code == 2 and "tools.0.function" in err


def test_cli_clear_empties_the_cache_dir(first_run: FirstRun, cli: Callable[..., tuple[int, str, str]],
                                         tmp_path: Path) -> None:
    cache_dir = _copy_cache(first_run, tmp_path / "cache")
    assert cli("clear", "--cache-dir", str(cache_dir))[:2] == (0, f"removed 3 entries from {cache_dir}\n")
    assert json.loads(cli("ls", "--json", "--cache-dir", str(cache_dir))[1]) == []
