"""`toolkv bench` end to end against a tiny random-weight model served on 127.0.0.1: the report
has its structure, the classes come from cached_tokens, the plots are real PNG files beside a
report.html; piped, the table is whole and carries no targets; `--json` prints only the report."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from gateway.bench.lab.targets import targets
from gateway.bench.server_settings import engine_of
from gateway.cli.main import main
from tests.support.server import LiveServer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(live: LiveServer, tiny_model_dir: Callable[..., Path],
        tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, str]:
    """The report, its folder, and what the command printed on stdout (a pipe, not a terminal)."""
    out = tmp_path_factory.mktemp("bench-out")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["bench", "--base-url", live.base_url, "--quick", "--out", str(out), "--tools", "4",
                     "--tool-counts", "2,4,100", "--groups", "3", "--clients", "3",
                     "--scenario", "single", "toolcount", "interleaved", "restart", "concurrent"])
    assert code == 0
    return json.loads((out / "bench.json").read_text()), out, stdout.getvalue()


@pytest.fixture(scope="module")
def report(run: tuple[dict[str, Any], Path, str]) -> tuple[dict[str, Any], Path]:
    return run[0], run[1]


def test_report_has_every_scenario_with_stats_per_class(report):
    data, _ = report
    assert data["toolkv_bench"] == 1 and data["model"] == "tiny-llama"
    assert set(data["scenarios"]) == {"single", "toolcount", "interleaved", "restart", "concurrent"}
    single = data["scenarios"]["single"]
    for cls in ("miss", "hit"):
        assert single["classes"][cls]["n"] >= 1
        assert single["classes"][cls]["ttft_ms"]["p50"] > 0
        assert single["classes"][cls]["ttft_ms"]["p95"] >= single["classes"][cls]["ttft_ms"]["p50"]
    assert single["classes"]["bypass"]["n"] == 0  # --quick sends no bypass request
    assert single["classes"]["errors"]["n"] == 0
    sample = single["samples"][0]
    assert {"ttft_s", "total_s", "cached_tokens", "prompt_tokens", "completion_tokens", "cache"} <= set(sample)


def test_speedup_is_miss_p50_over_hit_p50(report):
    single = report[0]["scenarios"]["single"]
    miss, hit = single["classes"]["miss"]["ttft_ms"]["p50"], single["classes"]["hit"]["ttft_ms"]["p50"]
    assert single["speedup"] == pytest.approx(miss / hit, rel=0.01)


def test_classes_follow_cached_tokens(report):
    for scenario in report[0]["scenarios"].values():
        for s in scenario.get("samples", []):
            if s["cache"] != "bypass":
                assert s["cache"] == ("hit" if s["cached_tokens"] > 0 else "miss")
            else:
                assert s["cached_tokens"] == 0


def test_interleaved_groups_hit_after_their_first_request(report):
    inter = report[0]["scenarios"]["interleaved"]
    assert inter["order"] == "ABCABC"
    assert inter["sequence"] == ["miss"] * 3 + ["hit"] * 3
    assert inter["every_repeat_hit"] is True
    assert targets(report[0])["interleaved_every_repeat_hits"] is True


def test_toolcount_skips_a_group_beyond_the_context(report):
    counts = report[0]["scenarios"]["toolcount"]
    assert set(counts["by_tools"]) == {"2", "4"}
    assert "context" in counts["skipped_counts"]["100"]
    for block in counts["by_tools"].values():
        assert block["classes"]["miss"]["n"] == 1 and block["classes"]["hit"]["n"] == 1


def test_restart_without_spawn_is_reported_as_skipped(report):
    assert "--spawn" in report[0]["scenarios"]["restart"]["skipped"]


def test_each_hit_is_split_by_the_servers_own_timing(report):
    """toolkv says where each request's time went: the overhead is paired per request, no floor
    loaded in the bench's process (that is the lab's)."""
    data = report[0]
    assert "floor" not in data and "targets" not in data and "checks" not in data
    single = data["scenarios"]["single"]
    assert single["overhead_from"] == "server-timing"  # toolkv says where each request's time went
    hits = [s for s in single["samples"] if s["cache"] == "hit"]
    assert all(s["server_timing_ms"]["prefill"] > 0 for s in hits)
    for s in hits:
        assert s["overhead_ms"] == pytest.approx(s["ttft_s"] * 1000 - s["server_timing_ms"]["prefill"], abs=0.01)
        assert 0 < s["overhead_ms"] < s["ttft_s"] * 1000
    assert single["hit_overhead_ms"] is not None and single["floor_ms_p50"] > 0


def test_concurrent_clients_all_get_answers(report):
    conc = report[0]["scenarios"]["concurrent"]
    assert [(c["mode"], c["clients"]) for c in conc["cases"]] == [("one-group", 3), ("mixed-groups", 3)]
    for case in conc["cases"]:
        assert case["hits"] == case["n"] == 3 and case["requests_per_s"] > 0
    assert conc["ratios"]["one-group"] == {"tokens_per_s_4_over_1": None, "hit_ttft_p50_4_over_1": None}


def test_plots_are_png_files(report):
    _, out = report
    for name in ("ttft_vs_tools.png", "timeline.png"):
        path = out / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        with Image.open(path) as image:
            image.verify()
            assert image.size[0] > 200 and image.size[1] > 200


def test_html_report_beside_the_plots_names_the_settings(report):
    data, out = report
    page = (out / "report.html").read_text()
    assert page.startswith("<!doctype html>") and "</html>" in page
    assert data["settings"]["toolkv_version"] and data["settings"]["server_version"]
    # a server the bench did not start says what it runs on in /version
    settings = data["settings"]
    assert (settings["device"], settings["dtype"], settings["backend"]) == ("cpu", "float32",
                                                                         "torch, fused layers, batch invariant")
    for text in ("tiny-llama", "device", "attention backend", "toolkv version", data["finished_at"], "<table"):
        assert text in page, text
    plots = sorted(path.name for path in out.glob("*.png"))
    assert plots == ["concurrency.png", "timeline.png", "ttft_vs_tools.png"]
    assert page.count("data:image/png;base64,") == len(plots)  # embedded: the page stands alone
    assert "http://" not in page.replace(data["base_url"], "")  # nothing loads from anywhere


def test_piped_output_is_whole_and_has_measurements_only(run):
    data, _, stdout = run
    assert "…" not in stdout  # no column cut to the 80 columns of a terminal that is not there
    assert "targets" not in stdout and "=True" not in stdout and "=False" not in stdout
    single = data["scenarios"]["single"]
    row = next(line for line in stdout.splitlines() if line.strip().startswith("single"))
    assert f"{single['classes']['hit']['ttft_ms']['p50']:.0f}" in row and f"{single['speedup']:.1f}x" in row
    assert "wrote" not in stdout  # the files written are said on stderr


def test_decode_of_one_stream_is_reported_in_ms_per_token(run):
    data, _, stdout = run
    single = data["scenarios"]["single"]
    samples = single["samples"]
    if samples[0]["cache"] == "miss" and any(s["cache"] == "miss" for s in samples[1:]):
        samples = samples[1:]  # the first request has its own line (report.warm_samples)
    answers = [s for s in samples if s["completion_tokens"] and s["completion_tokens"] >= 2]
    assert single["decode_ms_per_token"]["n"] == len(answers) > 0
    per_token = sorted((s["total_s"] - s["ttft_s"]) * 1000 / (s["completion_tokens"] - 1) for s in answers)
    assert per_token[0] <= single["decode_ms_per_token"]["p50"] <= per_token[-1]
    line = next(line for line in stdout.splitlines() if line.startswith("single: decode, one stream at a time: "))
    assert f"{single['decode_ms_per_token']['p50']:,.1f} ms/token p50" in line


def test_the_report_names_the_graphs_and_the_steps_launched_ahead_that_a_gpu_server_runs():
    """A GPU run's A/B (graphs of chunk steps off, decode steps read one by one) reads apart in the
    report: the backend line says what the server's /version says it runs."""
    engine = {"device": "cuda:0", "dtype": "bfloat16", "backend": "triton", "fused_layers": True,
              "batch_invariant": False, "cuda_graphs": True, "cuda_graph_max_tokens": 512, "decode_overlap": True}
    assert engine_of({"engine": engine})["backend"] == (
        "triton, fused layers, CUDA graphs (decode, chunk steps up to 512 tokens), decode steps launched ahead")
    engine.update(cuda_graph_max_tokens=0, decode_overlap=False)
    assert engine_of({"engine": engine})["backend"] == "triton, fused layers, CUDA graphs (decode)"
    engine.update(cuda_graphs_eager=3)  # captures that failed: a slower run says why
    assert engine_of({"engine": engine})["backend"] == (
        "triton, fused layers, CUDA graphs (decode; 3 failed to capture and run eagerly)")
