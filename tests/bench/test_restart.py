"""Scenario 4 (first request after a restart), through `toolkv bench --spawn`, which starts and
restarts `toolkv serve` itself (the scenario needs --spawn: tests/bench/test_bench_command.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.cli.main import main


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
    assert [(s["tags"]["phase"], s["cache"]) for s in restart["samples"]] == [
        ("before-restart", "miss"), ("first-after-restart", "hit"), ("second-after-restart", "hit")]
    assert restart["first_after_restart"] == "hit"
    before, first = (s["ttft_s"] for s in restart["samples"][:2])
    assert restart["restart_speedup"] == pytest.approx(before / first, rel=0.01)
    assert "Started server process" in (out / "server.log").read_text()
    settings = report["settings"]  # what the spawned server resolved its settings to, for report.html
    assert settings["device"] in ("cpu", "cuda") and settings["dtype"]
    assert settings["backend"].split(",")[0] in ("torch", "triton")
