"""Report arithmetic on hand-made samples: percentiles, classes, speedup, a hit's overhead from the
server's own timing; the options, the quick run, the lab's options without --lab, and the install
hint. The targets, the checks and the floor are the lab's (tests/bench/lab/test_targets.py)."""

from __future__ import annotations

import argparse
import sys

import pytest

from gateway.bench.client import Sample, parse_server_timing
from gateway.bench.command import _plan, _stdout_console, default_scenarios
from gateway.bench.concurrency_report import concurrent_stats, overlap_stats
from gateway.bench.context import ScenarioResult
from gateway.bench.lab.targets import targets
from gateway.bench.names import QUICK_SCENARIOS
from gateway.bench.options import _run, install_hint, register
from gateway.bench.report import build_report, print_table, scenario_dict, summary_lines
from gateway.bench.scenarios import SCENARIOS
from gateway.bench.stats import percentile


def sample(ttft_s: float, cached: int | None, *, bypass: bool = False, expected: str = "any",
           offset: int = 0) -> Sample:
    return Sample("single", "main", 20, offset, expected, bypass, 0.0, ttft_s=ttft_s, total_s=ttft_s + 0.7,
                  prompt_tokens=3000, cached_tokens=cached, completion_tokens=8)


def test_percentile_interpolates_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 50) is None


def test_class_comes_from_cached_tokens_and_the_bypass_header():
    assert sample(1.0, 2990).cache == "hit"
    assert sample(1.0, 0, expected="hit").cache == "miss"  # the server's word wins over the plan
    assert sample(1.0, 0, bypass=True).cache == "bypass"
    assert sample(1.0, None, expected="hit").cache == "hit"  # a server that reports no cached_tokens


def test_the_speedup_comes_from_warm_misses_the_first_request_apart():
    """--quick's single scenario: the first request (a cold miss), hits, one miss on a fresh group.
    The cold one as half of a two-miss median made a 74x speedup of a ~20x one."""
    first, hits, warm = sample(74.0, 0), [sample(1.0, 2990), sample(1.0, 2990), sample(1.0, 2990)], sample(20.0, 0)
    result = ScenarioResult("single", samples=[first, *hits, warm], details={"first_miss_ttft_ms": 74000.0})
    out = scenario_dict(result, SCENARIOS, {})
    assert out["classes"]["miss"]["n"] == 1 and out["classes"]["miss"]["ttft_ms"]["p50"] == 20000.0
    assert out["speedup"] == pytest.approx(20.0)
    assert len(out["samples"]) == 5 and out["first_miss_ttft_ms"] == 74000.0  # still reported, apart
    # no warm miss: the first counts
    alone = scenario_dict(ScenarioResult("single", samples=[first, *hits]), SCENARIOS, {})
    assert alone["classes"]["miss"]["n"] == 1 and alone["speedup"] == pytest.approx(74.0)


def test_the_first_request_line_says_how_busy_the_machine_was():
    """A first request's ratio means little without the load it was measured under (issue 35)."""
    first = sample(387.5, 0)
    lines = summary_lines(build_report({}, [ScenarioResult("single", samples=[first, sample(266.3, 0)], details={
        "first_miss_ttft_ms": 387500.0, "first_over_later_miss": 1.46, "first_after_start": True,
        "first_load_average": 15.2, "num_cpus": 2})], SCENARIOS), SCENARIOS)
    [line] = [line for line in lines if "first request" in line]
    assert line.endswith("1.46x a later miss of the same size (load average 15.2 on 2 cores)")


def test_server_timing_header_parsing():
    assert parse_server_timing('prepare;dur=1.25, queue;desc="q";dur=0.1,prefill;dur=400') == {
        "prepare": 1.25, "queue": 0.1, "prefill": 400.0}
    assert parse_server_timing("cache;desc=hit") is None and parse_server_timing(None) is None
    assert parse_server_timing("a;dur=x, b;dur=2") == {"b": 2.0}


def conc(case: str, ttft_s: float, tokens: int | None, *, cached: int = 2990, chunks: int = 0,
         phase: str = "measure") -> Sample:
    return Sample("concurrent", "shared", 20, 0, "hit", False, 0.0, ttft_s=ttft_s, total_s=ttft_s + 3.0,
                  prompt_tokens=3040, cached_tokens=cached, completion_tokens=tokens, token_chunks=chunks,
                  tags={"phase": phase, "case": case})


def test_concurrent_cases_tokens_per_s_and_ratios_against_one_client():
    samples = [conc("one-group@1", 0.4, 1, phase="warm"), conc("one-group@1", 0.40, 32), conc("one-group@1", 0.44, 32),
               *(conc("one-group@4", t, 32) for t in (0.5, 0.9, 1.3, 1.7)),
               conc("one-group@4", 9.0, 32, cached=0)]  # a miss: counted, not in the hit TTFT
    cases = [{"case": "one-group@1", "mode": "one-group", "clients": 1, "wall_s": 8.0},
             {"case": "one-group@4", "mode": "one-group", "clients": 4, "wall_s": 10.0}]
    out = concurrent_stats(samples, cases)
    one, four = out["cases"]
    assert one["n"] == 2 and one["hits"] == 2 and one["completion_tokens"] == 64  # the warm-up is not measured
    assert one["tokens_per_s"] == 8.0 and one["hit_ttft_ms"]["p50"] == 420.0
    assert four["n"] == 5 and four["hits"] == 4 and four["misses"] == 1 and out["misses_measured"] == 1
    assert four["tokens_per_s"] == 16.0 and four["hit_ttft_ms"]["p50"] == 1100.0
    assert four["tokens_per_s_vs_base"] == 2.0 and four["hit_ttft_p50_vs_base"] == pytest.approx(1100 / 420, abs=0.01)
    assert out["ratios"]["one-group"] == {"tokens_per_s_4_over_1": 2.0, "hit_ttft_p50_4_over_1": 2.62}
    checked = targets({"scenarios": {"concurrent": out}})
    assert checked["tokens_per_s_4_clients_at_least_2_5x"] is False
    assert checked["hit_ttft_4_clients_at_most_2x"] is False


def test_tokens_come_from_content_chunks_when_the_server_sends_no_usage():
    samples = [conc("one-group@1", 0.4, None, chunks=30), conc("one-group@1", 0.4, None, chunks=20)]
    out = concurrent_stats(samples, [{"case": "one-group@1", "mode": "one-group", "clients": 1, "wall_s": 5.0}])
    assert out["cases"][0]["tokens_from"] == "chunks" and out["cases"][0]["tokens_per_s"] == 10.0
    assert out["ratios"]["one-group"]["tokens_per_s_4_over_1"] is None  # no 4-client case


def test_compile_overlap_ratio_is_during_p50_over_alone_p50():
    def hit(ttft_s: float, phase: str, overlapped: bool = True) -> Sample:
        return Sample("compile-overlap", "shared", 20, 0, "hit", False, 0.0, ttft_s=ttft_s, cached_tokens=2990,
                      tags={"phase": phase, "overlapped": overlapped})

    samples = [hit(0.4, "warm"), hit(0.40, "alone"), hit(0.42, "alone"), hit(0.44, "alone"),
               hit(1.0, "during-compile"), hit(1.4, "during-compile"),
               hit(0.3, "during-compile", overlapped=False)]  # sent after the compile's first token
    out = overlap_stats(samples)
    assert out["hit_alone"] == {"n": 3, "ttft_ms": {"p50": 420.0, "p95": 438.0}}
    assert out["hit_during_compile"]["n"] == 2 and out["hit_during_compile"]["ttft_ms"]["p50"] == 1200.0
    assert out["during_over_alone"] == pytest.approx(1200 / 420, abs=0.01)
    assert targets({"scenarios": {"compile-overlap": out}})["hit_ttft_during_compile_at_most_4x"] is True


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["bench", "--base-url", "http://127.0.0.1:1", *argv])


def test_clients_option_is_a_comma_list():
    assert _plan(_args()).clients == (1, 4, 8) and _plan(_args("--quick")).clients == (1, 4)
    plan = _plan(_args("--clients", "8,1,4,4", "--requests-per-client", "3", "--concurrent-max-tokens", "64"))
    assert plan.clients == (1, 4, 8) and plan.requests_per_client == 3 and plan.concurrent_max_tokens == 64
    assert _plan(_args("--clients", "3")).clients == (3,)
    for bad in ("0,4", "1,x"):
        with pytest.raises(ValueError, match="--clients"):
            _plan(_args("--clients", bad))


def test_agent_options():
    plan = _plan(_args())
    assert plan.conversations == 1 and plan.agent_max_tokens == 16
    plan = _plan(_args("--conversations", "3", "--agent-max-tokens", "4"))
    assert plan.conversations == 3 and plan.agent_max_tokens == 4
    for bad in (("--conversations", "0"), ("--agent-max-tokens", "0")):
        with pytest.raises(ValueError, match=bad[0]):
            _plan(_args(*bad))


def test_the_table_carries_measurements_only():
    result = ScenarioResult("single", samples=[sample(8.0, 0), sample(0.45, 2990)])
    report = build_report({"model": "m", "base_url": "http://x"}, [result], SCENARIOS)
    console = _stdout_console()
    with console.capture() as captured:
        print_table(report, SCENARIOS, console)
    text = captured.get()
    assert "single" in text and "17.8x" in text and "target" not in text and "True" not in text


def test_the_console_is_wide_when_piped(monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    assert _stdout_console().width >= 200


def test_quick_runs_what_its_help_says():
    quick = _args("--quick")
    assert default_scenarios(quick, SCENARIOS) == list(QUICK_SCENARIOS) == ["single", "interleaved"]
    plan = _plan(quick)
    assert (plan.tools, plan.requests, plan.misses, plan.bypass, plan.groups, plan.rounds) == (10, 3, 2, 0, 2, 2)
    assert sum(SCENARIOS[n].planned(plan) for n in QUICK_SCENARIOS) == 9
    assert "restart" not in default_scenarios(_args(), SCENARIOS) and "single" in default_scenarios(_args(), SCENARIOS)


def test_install_hint_names_the_extra(monkeypatch, capsys):
    assert '".[bench]"' in install_hint()  # this is a checkout
    monkeypatch.setitem(sys.modules, "gateway.bench.command", None)  # as if an import of it failed
    assert _run(_args()) == 2
    err = capsys.readouterr().err
    assert "needs the bench extra" in err and '".[bench]"' in err and "'toolkv[bench]'" not in err


@pytest.mark.parametrize("argv", [("--scenario", "fleet"), ("--scenario", "single", "hostile-soak"), ("--floor",)])
def test_the_labs_scenarios_and_floor_need_lab(argv, capsys):
    assert _run(_args(*argv)) == 2
    assert "is part of the lab: add --lab" in capsys.readouterr().err
