"""The hostile-soak scenario end to end through `toolkv bench` against a tiny-model server with two
API keys: key B's requests all succeed alone and under key A's hostile mix, no hostile request gets
a 5xx (or a connection the server dropped), and the report has the ratio and the RSS readings. No
timing thresholds: the tiny model on a shared CPU says nothing about them."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.bench.lab.hostile import HOSTILE_KEY_ENV
from gateway.cli.main import main
from gateway.settings import load_settings
from tests.support.server import LiveServer, serve

KEY_B, KEY_A = "key-normal-b", "key-hostile-a"


@pytest.fixture(scope="module")
def keyed(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "min_prefix_tokens": 8,
                                        "api_keys": (KEY_B, KEY_A),
                                        "cache_dir": str(tmp_path_factory.mktemp("cache"))}, environ={})
    with serve(settings) as server:
        yield server


@pytest.fixture(scope="module")
def soak(keyed: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("hostile-out")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setenv(HOSTILE_KEY_ENV, KEY_A)
        code = main(["bench", "--base-url", keyed.base_url, "--api-key", KEY_B, "--lab", "--scenario", "hostile-soak",
                     "--no-floor", "--requests", "1", "--out", str(out)])
    assert code == 0
    return json.loads((out / "bench.json").read_text()), printed.getvalue()


def test_key_b_succeeds_alone_and_under_attack(soak):
    h = soak[0]["scenarios"]["hostile-soak"]
    assert h["skipped"] is None and h["notes"] == []
    assert h["b_requests"] == 3 and h["b_errors"] == 0
    phases = [s["tags"]["phase"] for s in h["samples"]]
    assert phases.count("alone") == phases.count("attack") == 3
    assert all(s["error"] is None for s in h["samples"])


def test_no_hostile_request_gets_a_5xx(soak):
    h = soak[0]["scenarios"]["hostile-soak"]
    assert h["hostile_requests"] > 0 and h["hostile_failures"] == 0
    codes = {code for counts in h["hostile_statuses"].values() for code in counts}
    assert not any(c.startswith(("5", "error")) for c in codes), h["hostile_statuses"]
    assert "malformed-json" in h["hostile_statuses"] and "deep-nesting" in h["hostile_statuses"]


def test_the_report_has_the_ratio_and_rss(soak):
    report, printed = soak
    h = report["scenarios"]["hostile-soak"]
    assert h["b_ratio_p50"] is not None and h["b_alone_ms"]["p50"] and h["b_attack_ms"]["p95"]
    assert h["rss_start_mb"] and h["rss_end_mb"] and h["rss_growth_mb"] is not None
    assert "hostile-soak: key B" in printed and "server RSS start" in printed
    series = h["rss_during_attack_mb"]  # A's start, a reading per tenth of B's requests, the end
    assert series[0] == h["rss_start_mb"] and series[-1] == h["rss_end_mb"] and len(series) >= 3
    assert "after every tenth of B's requests" in printed
    assert "checks" not in report  # targets are checked only with --check
    assert set(report["targets"]) >= {"hostile_b_within_2x", "hostile_rss_bounded", "hostile_no_5xx"}


def test_a_spawned_soak_server_gets_small_bounds_that_fill_within_the_run(monkeypatch):
    """The KV pool's pages and the grammar cache fill toward their bounds for the whole run at the
    default sizes; a spawned soak server gets small ones (reported in the meta) unless the
    environment sets them, so the RSS growth that is left is memory no bound holds."""
    from gateway.bench.lab.hostile import SPAWN_BOUNDS, spawn_bounds

    monkeypatch.delenv("TOOLKV_RAM_BUDGET_BYTES", raising=False)
    monkeypatch.setenv("TOOLKV_GRAMMAR_CACHE_BYTES", "64MiB")
    assert spawn_bounds() == {"TOOLKV_RAM_BUDGET_BYTES": SPAWN_BOUNDS["TOOLKV_RAM_BUDGET_BYTES"],
                              "TOOLKV_GRAMMAR_CACHE_BYTES": "64MiB"}
