"""Scenario 4 (first request after a restart): in-process with a restartable server on the same
cache dir, and through `toolkv bench --spawn`, which starts and restarts `toolkv serve` itself."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import pytest

from gateway.api.app import create_app
from gateway.bench.client import BenchClient
from gateway.bench.context import Context, Plan
from gateway.bench.scenarios import run_restart
from gateway.bench.workload import Workload
from gateway.cli.main import main
from gateway.settings import Settings, load_settings
from tests.support.server import serve_app


class RestartableServer:
    """The gateway app in this process; `restart` stops it and builds a new one on the same cache dir."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.stack = ExitStack()
        self.base_url = self._start()

    def _start(self) -> str:
        return self.stack.enter_context(serve_app(create_app(self.settings))).base_url

    async def restart(self) -> str:
        await asyncio.to_thread(self.stack.close)
        self.stack = ExitStack()
        self.base_url = await asyncio.to_thread(self._start)
        return self.base_url


def _settings(model_dir: Path, cache_dir: Path) -> Settings:
    return load_settings(overrides={"model": str(model_dir), "min_prefix_tokens": 8, "cache_dir": str(cache_dir)},
                         environ={})


def test_first_request_after_restart_is_served_from_disk(tiny_model_dir: Callable[..., Path], tmp_path: Path,
                                                         merchant_tools):
    server = RestartableServer(_settings(tiny_model_dir("llama"), tmp_path / "cache"))
    try:
        result = asyncio.run(_restart_scenario(server, merchant_tools))
    finally:
        server.stack.close()
    before, first, again = result.samples
    assert before.cache == "miss" and first.tags["phase"] == "first-after-restart"
    assert first.cache == "hit" and again.cache == "hit"
    assert result.details["first_after_restart"] == "hit"
    assert result.details["restart_speedup"] == pytest.approx(before.ttft_s / first.ttft_s, rel=0.01)


async def _restart_scenario(server: RestartableServer, tools: list) -> object:
    client = BenchClient(server.base_url, None, 60.0, time.perf_counter())
    workload = Workload(tools, "t1", model=None, max_tokens=2, tool_choice="none", tools_in_system=False)
    ctx = Context(client, workload, Plan(tools=4), server, lambda s: None, lambda n: None)
    try:
        return await run_restart(ctx)
    finally:
        await client.aclose()


@pytest.mark.e2e  # starts `toolkv serve` twice in subprocesses: ~30 s on a busy 2-core machine
def test_spawn_mode_runs_the_restart_scenario_on_its_own_server(tiny_model_dir: Callable[..., Path],
                                                                 tmp_path: Path):
    out = tmp_path / "out"
    code = main(["bench", "--spawn", "--model", str(tiny_model_dir("llama")), "--scenario", "restart",
                 "--quick", "--tools", "4", "--no-floor", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    restart = report["scenarios"]["restart"]
    assert report["spawned"] is True and restart["skipped"] is None
    assert [s["tags"]["phase"] for s in restart["samples"]] == [
        "before-restart", "first-after-restart", "second-after-restart"]
    assert restart["first_after_restart"] == "hit"
    before, first = (s["ttft_s"] for s in restart["samples"][:2])
    assert restart["restart_speedup"] == pytest.approx(before / first, rel=0.01)
    assert "Started server process" in (out / "server.log").read_text()
    settings = report["settings"]  # what the spawned server resolved its settings to, for report.html
    assert settings["device"] in ("cpu", "cuda") and settings["dtype"]
    assert settings["backend"].split(",")[0] in ("torch", "triton")
