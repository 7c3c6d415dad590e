"""The concurrent and compile-overlap scenarios end to end through `toolkv bench` against the tiny
model: every case warms its groups so the measured requests are hits, each case has hit TTFT and
output tokens/s, the issue's ratios are computed, and the table and the plot show them. No timing
thresholds: the tiny model's numbers say nothing about speed, only that they were measured."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from gateway.bench.lab.targets import targets
from gateway.cli.main import main
from tests.support.server import LiveServer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CLIENTS = (1, 2, 4)


@pytest.fixture(scope="module")
def run(live: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, str]:
    out = tmp_path_factory.mktemp("bench-concurrency")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setenv("COLUMNS", "200")  # rich sizes its tables to the terminal; keep the rows on one line
        code = main(["bench", "--base-url", live.base_url, "--quick", "--tools", "4", "--no-floor",
                     "--clients", ",".join(map(str, CLIENTS)), "--mixed-groups", "4", "--concurrent-max-tokens", "6",
                     "--compile-tools", "20", "--out", str(out), "--scenario", "concurrent", "compile-overlap"])
    assert code == 0
    return json.loads((out / "bench.json").read_text()), out, printed.getvalue()


def test_every_case_of_both_modes_is_measured(run):
    conc = run[0]["scenarios"]["concurrent"]
    assert conc["skipped"] is None and conc["errors"] == 0 and conc["misses_measured"] == 0
    assert [(c["mode"], c["clients"]) for c in conc["cases"]] == (
        [("one-group", n) for n in CLIENTS] + [("mixed-groups", n) for n in CLIENTS])
    for case in conc["cases"]:
        assert case["n"] == case["hits"] == case["clients"]  # --quick: one request per client
        assert case["hit_ttft_ms"]["p50"] > 0 and case["hit_ttft_ms"]["p95"] >= case["hit_ttft_ms"]["p50"]
        assert case["tokens_from"] == "usage" and case["completion_tokens"] > 0
        assert case["tokens_per_s"] > 0 and case["requests_per_s"] > 0 and case["wall_s"] > 0
        assert case["tokens_per_s"] == pytest.approx(case["completion_tokens"] / case["wall_s"], rel=0.01)
        assert case["base_clients"] == 1 and case["tokens_per_s_vs_base"] > 0


def test_measured_requests_are_hits_after_their_case_warmed_its_groups(run):
    samples = run[0]["scenarios"]["concurrent"]["samples"]
    for case in {s["tags"]["case"] for s in samples}:
        own = [s for s in samples if s["tags"]["case"] == case]
        warm = [s for s in own if s["tags"]["phase"] == "warm"]
        measured = [s for s in own if s["tags"]["phase"] == "measure"]
        assert warm and measured
        assert max(s["started_s"] for s in warm) < min(s["started_s"] for s in measured)
        assert {s["group"] for s in measured} <= {s["group"] for s in warm}
        assert all(s["cache"] == "hit" and s["cached_tokens"] > 0 for s in measured)


def test_mixed_cases_send_simultaneous_requests_to_different_groups(run):
    samples = run[0]["scenarios"]["concurrent"]["samples"]
    measured = [s for s in samples if s["tags"]["phase"] == "measure"]
    for n in CLIENTS:
        one = [s for s in measured if s["tags"]["case"] == f"one-group@{n}"]
        mixed = [s for s in measured if s["tags"]["case"] == f"mixed-groups@{n}"]
        assert {s["group"] for s in one} == {"shared"}
        assert sorted(s["tags"]["client"] for s in mixed) == list(range(n))
        assert len({s["group"] for s in mixed}) == n  # one group per client (--mixed-groups 4)


def test_ratios_four_clients_over_one(run):
    data = run[0]
    ratios = data["scenarios"]["concurrent"]["ratios"]
    cases = {(c["mode"], c["clients"]): c for c in data["scenarios"]["concurrent"]["cases"]}
    for mode in ("one-group", "mixed-groups"):
        one, four = cases[(mode, 1)], cases[(mode, 4)]
        assert ratios[mode]["tokens_per_s_4_over_1"] == pytest.approx(
            four["tokens_per_s"] / one["tokens_per_s"], rel=0.02, abs=0.006)  # stored to 2 decimals
        assert ratios[mode]["hit_ttft_p50_4_over_1"] == pytest.approx(
            four["hit_ttft_ms"]["p50"] / one["hit_ttft_ms"]["p50"], rel=0.02, abs=0.006)
    met = targets(data)  # the lab's targets read the user's report
    assert isinstance(met["tokens_per_s_4_clients_at_least_2_5x"], bool)
    assert isinstance(met["hit_ttft_4_clients_at_most_2x"], bool)


def test_compile_overlap_times_hits_alone_and_during_a_compile(run):
    data = run[0]
    o = data["scenarios"]["compile-overlap"]
    assert o["skipped"] is None and o["errors"] == 0
    assert o["compile_cache"] == "miss" and o["compile_group_tools"] == 20
    assert o["compile_ttft_ms"] > 0 and o["compile_server_ms"] > 0  # toolkv's Server-Timing `compile`
    phases = [s["tags"]["phase"] for s in o["samples"]]
    assert phases[:3] == ["warm", "alone", "alone"] and phases[3] == "compile"
    assert o["hit_alone"]["n"] == 2 and o["hit_alone"]["ttft_ms"]["p50"] > 0
    assert o["hit_during_compile"]["n"] >= 1 and o["hit_during_compile"]["ttft_ms"]["p50"] > 0
    assert o["during_over_alone"] == pytest.approx(  # stored to 2 decimals: 0.2 can stand for 0.195
        o["hit_during_compile"]["ttft_ms"]["p50"] / o["hit_alone"]["ttft_ms"]["p50"], rel=0.02, abs=0.006)
    compile_sample = next(s for s in o["samples"] if s["tags"]["phase"] == "compile")
    hits = [s for s in o["samples"] if s["tags"]["phase"] != "compile"]
    assert compile_sample["prompt_tokens"] == o["compile_prompt_tokens"]
    assert compile_sample["prompt_tokens"] > max(s["prompt_tokens"] for s in hits)  # 20 tools vs 4
    during = [s for s in o["samples"] if s["tags"]["phase"] == "during-compile"]
    assert all(s["cache"] == "hit" for s in during)
    assert during[0]["started_s"] > compile_sample["started_s"]  # sent once the compile was on the wire
    assert isinstance(targets(data)["hit_ttft_during_compile_at_most_4x"], bool)


def test_table_prints_cases_and_ratios(run):
    _, _, printed = run
    assert "concurrency: streaming clients at once" in printed
    assert "mixed-groups" in printed and "hit+compile" in printed
    assert "output tokens/s at 4 clients / 1 client" in printed
    assert "hit TTFT p50 during a compile / alone" in printed


def test_concurrency_plot_is_a_png(run):
    _, out, _ = run
    path = out / "concurrency.png"
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.verify()
        assert image.size[0] > 600 and image.size[1] > 200
