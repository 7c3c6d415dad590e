"""`toolkv bench --peer-url`: a second real toolkv on 127.0.0.1 as the peer. Every body goes to
both servers, in turns, so both count the same prompt tokens; each side has its miss and hit
TTFT, decode ms/token and tokens/s per client count, in the JSON, the table and report.html. No
timing thresholds: the tiny model's numbers say nothing about speed, only that they were measured."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.bench.client import parse_metrics
from gateway.bench.command import _plan, scenario_names
from gateway.bench.memory import memory_from_metrics, memory_lines
from gateway.bench.options import register
from gateway.bench.scenarios import SCENARIOS
from gateway.cli.main import main
from gateway.settings import load_settings
from tests.support.server import LiveServer, serve

CLIENTS = (1, 2)
TURNS = 1 + 2 + 1  # --quick: a miss and 2 hits on one group, one decode stream


@pytest.fixture(scope="module")
def peer(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "min_prefix_tokens": 8,
                                        "served_model_name": "tiny-peer",
                                        "cache_dir": str(tmp_path_factory.mktemp("peer-cache"))}, environ={})
    with serve(settings) as server:
        yield server


@pytest.fixture(scope="module")
def run(live: LiveServer, peer: LiveServer,
        tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, str]:
    out = tmp_path_factory.mktemp("bench-peer")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setenv("COLUMNS", "200")
        code = main(["bench", "--base-url", live.base_url, "--peer-url", peer.base_url, "--quick", "--tools", "4",
                     "--clients", ",".join(map(str, CLIENTS)), "--out", str(out)])
    assert code == 0
    return json.loads((out / "bench.json").read_text()), out, printed.getvalue()


def test_peer_runs_alone_with_both_servers_measured(run):
    data = run[0]
    assert list(data["scenarios"]) == ["peer"]  # --peer-url without --scenario
    p = data["scenarios"]["peer"]
    assert p["skipped"] is None and p["errors"] == 0 and p["peer_model"] == "tiny-peer"
    for name in ("toolkv", "peer"):
        server = p["servers"][name]
        assert server["miss_ttft_ms"]["n"] == 1 and server["hit_ttft_ms"]["n"] == 2
        assert server["miss_ttft_ms"]["p50"] > 0 and server["hit_ttft_ms"]["p50"] > 0
        assert server["hits_cached"] == 2  # both are toolkv: every repeat found its group
        assert server["decode_ms_per_token"]["n"] == 1 and server["decode_ms_per_token"]["p50"] > 0
        assert [c["clients"] for c in server["clients"]] == list(CLIENTS)
        for case in server["clients"]:
            assert case["n"] == case["clients"] and case["errors"] == 0 and case["tokens_from"] == "usage"
            assert case["tokens_per_s"] == pytest.approx(case["completion_tokens"] / case["wall_s"], rel=0.01)
    assert set(p["ratios"]["tokens_per_s"]) == {str(c) for c in CLIENTS}


def test_every_body_goes_to_both_in_turns_and_both_count_the_same_prompt(run):
    p = run[0]["scenarios"]["peer"]
    turns: dict[int, list[dict[str, Any]]] = {}
    for s in p["samples"]:
        if "turn" in s["tags"]:
            turns.setdefault(s["tags"]["turn"], []).append(s)
    assert len(turns) == TURNS
    for turn, pair in turns.items():
        first, second = sorted(pair, key=lambda s: s["started_s"])
        assert (first["tags"]["server"], second["tags"]["server"]) == (
            ("toolkv", "peer") if turn % 2 == 0 else ("peer", "toolkv"))
        assert first["prompt_tokens"] == second["prompt_tokens"] > 0
    assert p["prompt_tokens"] == {"pairs": TURNS, "same": TURNS, "peer_minus_toolkv_p50": 0}


def test_decode_ms_per_token_is_the_time_after_the_first_token_per_token(run):
    p = run[0]["scenarios"]["peer"]
    for name in ("toolkv", "peer"):
        decode = next(s for s in p["samples"] if s["tags"]["server"] == name and s["tags"]["phase"] == "decode")
        assert decode["completion_tokens"] > 2  # the tiny model talks until max_tokens
        expected = (decode["total_s"] - decode["ttft_s"]) * 1000 / (decode["completion_tokens"] - 1)
        assert p["servers"][name]["decode_ms_per_token"]["p50"] == pytest.approx(expected, abs=0.1)


def test_the_peer_served_exactly_its_share(run, peer: LiveServer):
    samples = run[0]["scenarios"]["peer"]["samples"]
    requests = parse_metrics(httpx.get(peer.base_url + "/metrics").text)
    served = sum(v for k, v in requests.items() if k.startswith("toolkv_requests_total{"))
    assert served == sum(1 for s in samples if s["tags"]["server"] == "peer") == len(samples) // 2


def test_table_and_page_show_both_columns(run):
    data, out, printed = run
    assert "side by side: toolkv and the peer at" in printed
    for label in ("miss TTFT (ms)", "hit TTFT (ms)", "decode, one stream (ms/token)", "tokens/s, 2 clients"):
        assert label in printed, label
    assert "the same prompt token count on 4 of 4 bodies sent to both" in printed
    page = (out / "report.html").read_text()
    assert "Side by side: toolkv and the peer at" in page and "tokens/s, 1 client<" in page
    assert "memory (weights, KV pool, CUDA graphs)" in page
    assert data["options"]["peer_url"].startswith("http://127.0.0.1:")


def test_report_carries_the_servers_memory(run, live: LiveServer):
    memory = live.app.state.gateway.model.runtime.engine.runner.memory()
    assert run[0]["memory"] == {"weights_bytes": memory.weights_bytes, "kv_pool_bytes": memory.kv_pool_bytes,
                                "cuda_graphs_bytes": 0}


def test_memory_comes_from_the_gauge_per_part():
    text = ('# TYPE toolkv_memory_bytes gauge\ntoolkv_memory_bytes{part="weights"} 5.4e+08\n'
            'toolkv_memory_bytes{part="kv_pool"} 2147483648.0\ntoolkv_memory_bytes{part="cuda_graphs"} 0.0\n')
    memory = memory_from_metrics(parse_metrics(text))
    assert memory == {"weights_bytes": 540_000_000, "kv_pool_bytes": 2**31, "cuda_graphs_bytes": 0}
    assert memory_lines(memory) == ["memory (the server's engine, on its device): weights 540.0 MB, KV pool 2.15 GB, "
                                    "CUDA graphs 0.0 MB"]
    assert memory_from_metrics({}) == dict.fromkeys(("weights_bytes", "kv_pool_bytes", "cuda_graphs_bytes"))


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["bench", "--base-url", "http://127.0.0.1:1", *argv])


def test_peer_url_adds_the_peer_scenario_and_the_clients_it_compares():
    assert scenario_names(_args("--peer-url", "http://x"), SCENARIOS) == ["peer"]
    assert scenario_names(_args("--peer-url", "http://x", "--scenario", "peer", "single"), SCENARIOS) == [
        "single", "peer"]
    assert _plan(_args("--peer-url", "http://x")).peer_clients == (1, 4, 16, 32)
    assert _plan(_args("--peer-url", "http://x", "--clients", "2,1")).peer_clients == (1, 2)
    with pytest.raises(ValueError, match="--peer-url"):
        _plan(_args("--scenario", "peer"))
