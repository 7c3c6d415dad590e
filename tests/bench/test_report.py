"""Report arithmetic on hand-made samples: percentiles, classes, speedup, the floor's overhead; the
checks of --check, where the floor runs, the quick run and the install hint."""

from __future__ import annotations

import argparse
import socket
import sys

import pytest

from gateway.bench.client import Sample, parse_server_timing
from gateway.bench.command import _default_scenarios, _plan, _stdout_console
from gateway.bench.concurrency_report import concurrent_stats, overlap_stats
from gateway.bench.context import ScenarioResult
from gateway.bench.lab.floor import FloorResult, server_is_local
from gateway.bench.lab.floor_report import floor_dict
from gateway.bench.lab.targets import DESCRIBE, check_lines, checks
from gateway.bench.names import QUICK_SCENARIOS
from gateway.bench.options import _run, install_hint, register
from gateway.bench.report import block, build_report, print_table, scenario_dict, summary_lines, targets
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


def test_speedup_floor_and_overhead():
    samples = [sample(8.0, 0), sample(10.0, 0), sample(0.40, 2990), sample(0.50, 2990), sample(0.45, 2990),
               sample(9.0, 0, bypass=True), sample(5.0, 2990, offset=20)]  # another slice: not in the overhead
    floor = FloorResult("main", 20, 2990, 30, 8.0, (400.0, 420.0, 440.0), (1.0,), (5.0,), (425.0,))
    out = block(samples, {20: floor})
    assert out["classes"]["miss"]["ttft_ms"] == {"p50": 9000.0, "p95": 9900.0}
    assert out["classes"]["hit"]["n"] == 4 and out["classes"]["bypass"]["n"] == 1
    assert out["speedup"] == pytest.approx(9000.0 / out["classes"]["hit"]["ttft_ms"]["p50"], rel=0.01)
    assert out["floor_ms_p50"] == 420.0
    assert out["hit_overhead_ms"] == pytest.approx(450.0 - 420.0)
    assert out["classes"]["hit"]["decode_tokens_per_s_p50"] == pytest.approx(7 / 0.7)


def test_the_speedup_comes_from_warm_misses_the_first_request_apart():
    """--quick's single scenario: the first request (a cold miss), hits, one miss on a fresh group.
    The cold one as half of a two-miss median made a 74x speedup of a ~20x one."""
    first, hits, warm = sample(74.0, 0), [sample(1.0, 2990), sample(1.0, 2990), sample(1.0, 2990)], sample(20.0, 0)
    result = ScenarioResult("single", samples=[first, *hits, warm], details={"first_miss_ttft_ms": 74000.0})
    out = scenario_dict(result, {})
    assert out["classes"]["miss"]["n"] == 1 and out["classes"]["miss"]["ttft_ms"]["p50"] == 20000.0
    assert out["speedup"] == pytest.approx(20.0)
    assert len(out["samples"]) == 5 and out["first_miss_ttft_ms"] == 74000.0  # still reported, apart
    alone = scenario_dict(ScenarioResult("single", samples=[first, *hits]), {})  # no warm miss: the first counts
    assert alone["classes"]["miss"]["n"] == 1 and alone["speedup"] == pytest.approx(74.0)


def test_the_first_request_line_says_how_busy_the_machine_was():
    """A first request's ratio means little without the load it was measured under (issue 35)."""
    first = sample(387.5, 0)
    lines = summary_lines(build_report({}, [ScenarioResult("single", samples=[first, sample(266.3, 0)], details={
        "first_miss_ttft_ms": 387500.0, "first_over_later_miss": 1.46, "first_after_start": True,
        "first_load_average": 15.2, "num_cpus": 2})], {}, None))
    [line] = [line for line in lines if "first request" in line]
    assert line.endswith("1.46x a later miss of the same size (load average 15.2 on 2 cores)")


def test_server_timing_pairs_each_hit_with_its_own_model_prefill():
    hits = [sample(0.410, 2990), sample(0.530, 2990), sample(0.445, 2990)]
    for s, prefill_ms in zip(hits, (400.0, 510.0, 430.0), strict=True):
        s.server_timing_ms = {"prepare": 1.2, "queue": 0.1, "restore": 1.0, "prefill": prefill_ms}
    out = block([sample(8.0, 0), *hits], {})
    assert [s.overhead_ms for s in hits] == pytest.approx([10.0, 20.0, 15.0])
    assert out["overhead_from"] == "server-timing"
    assert out["floor_ms_p50"] == 430.0
    assert out["hit_overhead_ms"] == pytest.approx(15.0) and out["hit_overhead_ms_p95"] == pytest.approx(19.5)
    single = {"speedup": 17.0, **out, "samples": [s.to_dict() for s in hits]}
    paired_probe = {"20": {"paired_overhead_ms": {"p50": 80.0}}}  # ignored: the per-request pairing wins
    assert targets({"single": single}, paired_probe)["hit_overhead_under_20ms"] is True


def test_server_timing_header_parsing():
    assert parse_server_timing('prepare;dur=1.25, queue;desc="q";dur=0.1,prefill;dur=400') == {
        "prepare": 1.25, "queue": 0.1, "prefill": 400.0}
    assert parse_server_timing("cache;desc=hit") is None and parse_server_timing(None) is None
    assert parse_server_timing("a;dur=x, b;dur=2") == {"b": 2.0}


FLEET_UNMEASURED = dict.fromkeys(("fleet_hits_after_first", "fleet_first_compile_on_one_replica", "fleet_hot_spreads",
                                  "fleet_hot_p95_within_2x_balanced"))


def test_targets_are_unknown_when_not_measured():
    assert targets({}) == {"hit_speedup_at_least_15x": None, "hit_overhead_under_20ms": None,
                           "first_request_at_most_2x_a_later_miss": None, "interleaved_every_repeat_hits": None,
                           "restart_at_least_10x_faster": None,
                           "tokens_per_s_4_clients_at_least_2_5x": None, "hit_ttft_4_clients_at_most_2x": None,
                           "hit_ttft_during_compile_at_most_4x": None, "rss_flat_over_soak": None,
                           "agent_computes_only_new_messages": None, "history_rss_flat": None,
                           "constrained_all_valid": None, "constraint_cost_at_most_10pct_of_decode": None,
                           **FLEET_UNMEASURED}
    assert targets({"soak": {"rss_first_mb": 1276.0, "rss_growth_mb": 30.0}})["rss_flat_over_soak"] is True
    assert targets({"soak": {"rss_first_mb": 1276.0, "rss_growth_mb": 200.0}})["rss_flat_over_soak"] is False
    quick = {"speedup": 13.1, "samples": [{"num_tools": 10}]}  # --quick: a 10-tool group's miss is cheaper
    assert targets({"single": quick})["hit_speedup_at_least_15x"] is None
    assert targets({"single": {**quick, "samples": [{"num_tools": 20}]}})["hit_speedup_at_least_15x"] is False
    first = "first_request_at_most_2x_a_later_miss"
    assert targets({"single": {"first_over_later_miss": 1.3, "first_after_start": True}})[first] is True
    assert targets({"single": {"first_over_later_miss": 3.1, "first_after_start": True}})[first] is False
    assert targets({"single": {"first_over_later_miss": 1.3, "first_after_start": False}})[first] is None
    measured = targets({"single": {"speedup": 22.0, "hit_overhead_ms": 12.0},
                        "interleaved": {"every_repeat_hit": True},
                        "restart": {"skipped": None, "first_after_restart": "miss", "restart_speedup": 1.1}})
    assert measured == {"hit_speedup_at_least_15x": True, "hit_overhead_under_20ms": True,
                        "first_request_at_most_2x_a_later_miss": None, "interleaved_every_repeat_hits": True,
                        "restart_at_least_10x_faster": False,
                        "tokens_per_s_4_clients_at_least_2_5x": None, "hit_ttft_4_clients_at_most_2x": None,
                        "hit_ttft_during_compile_at_most_4x": None, "rss_flat_over_soak": None,
                        "agent_computes_only_new_messages": None, "history_rss_flat": None,
                        "constrained_all_valid": None, "constraint_cost_at_most_10pct_of_decode": None,
                        **FLEET_UNMEASURED}


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
    checked = targets({"concurrent": out})
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
    assert targets({"compile-overlap": out})["hit_ttft_during_compile_at_most_4x"] is True


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


def _floor(floor_ms: tuple[float, ...], http_ms: tuple[float | None, ...]) -> FloorResult:
    return FloorResult("main", 20, 2990, 30, 8.0, floor_ms, (0.0,) * len(floor_ms), (2.0,) * len(floor_ms),
                       floor_ms, http_ttft_ms=http_ms)


def test_a_floor_slower_than_its_hit_gives_no_overhead_not_a_negative_one():
    out = floor_dict(_floor((4900.0, 400.0, 410.0), (470.0, 430.0, None)), shares_cpu=True)
    assert out["paired_overhead_ms"]["p50"] == 30.0 and out["negative_pairs"] == 1 and out["shares_cpu"] is True
    assert floor_dict(_floor((4900.0,), (470.0,)))["paired_overhead_ms"] == {"p50": None, "p95": None}
    busy = block([sample(8.0, 0), sample(0.47, 2990)], {20: _floor((4900.0,), (470.0,))})
    assert busy["floor_ms_p50"] == 4900.0 and busy["hit_overhead_ms"] is None  # probe floor above the hit


def test_a_floor_beside_the_server_is_labelled_and_never_stands_in_for_the_overhead():
    result = ScenarioResult("single", samples=[sample(8.0, 0), sample(0.45, 2990), sample(0.46, 2990)])
    floors = {20: _floor((300.0, 310.0, 320.0), (450.0, 460.0, 455.0))}
    shared = build_report({}, [result], floors, None, floor_shares_cpu=True)
    assert shared["floor"]["note"] == "unreliable: shares the CPU with the server"
    assert "hit_overhead_ms" not in shared["scenarios"]["single"]  # the probe's floor is not used
    assert shared["targets"]["hit_overhead_under_20ms"] is None
    remote = build_report({}, [result], floors, None)
    assert remote["floor"]["note"] is None and remote["scenarios"]["single"]["hit_overhead_ms"] == 145.0
    assert remote["targets"]["hit_overhead_under_20ms"] is False  # the probe's pairing: 145 ms


def test_checks_say_what_was_measured_and_which_targets_were_missed():
    report = {"scenarios": {"single": {"speedup": 9.5, "hit_overhead_ms": 12.0},
                            "soak": {"rss_first_mb": 1276.0, "rss_growth_mb": 200.0}}, "floor": {"by_tools": {}}}
    report["targets"] = targets(report["scenarios"])
    found = {c.name: c for c in checks(report)}
    assert len(found) == 17
    assert found["hit_speedup_at_least_15x"].result == "missed"
    assert "9.50x" in found["hit_speedup_at_least_15x"].line and ">= 15x" in found["hit_speedup_at_least_15x"].line
    assert found["hit_overhead_under_20ms"].result == "ok" and "+12.0 ms" in found["hit_overhead_under_20ms"].line
    assert found["rss_flat_over_soak"].result == "missed" and "+15.7%" in found["rss_flat_over_soak"].line
    assert found["restart_at_least_10x_faster"].result == "not measured"
    lines = check_lines(list(found.values()))
    assert lines[0] == "check: 2 of 3 measured targets missed (14 not measured by this run's scenarios)"
    assert lines[1].startswith("  MISSED hit_speedup_at_least_15x: ") and len(lines) == 4


def test_every_target_has_its_line():
    """A target added to report.targets without a line in checks.DESCRIBE would print its bare name."""
    hostile = {"b_ratio_p50": 1.4, "rss_start_mb": 1000.0, "rss_growth_mb": 300.0, "hostile_failures": 0,
               "b_errors": 0}
    report = {"scenarios": {"hostile-soak": hostile}, "floor": {"by_tools": {}}}
    report["targets"] = targets(report["scenarios"])
    assert set(report["targets"]) == set(DESCRIBE)
    found = {c.name: c for c in checks(report)}
    assert found["hostile_rss_bounded"].result == "missed" and "+30.0% of 1,000 MB" in found["hostile_rss_bounded"].line
    assert found["hostile_b_within_2x"].result == "ok" and found["hostile_no_5xx"].result == "ok"


def test_the_table_carries_measurements_only():
    result = ScenarioResult("single", samples=[sample(8.0, 0), sample(0.45, 2990)])
    report = build_report({"model": "m", "base_url": "http://x"}, [result], {}, "why not", False)
    console = _stdout_console()
    with console.capture() as captured:
        print_table(report, console)
    text = captured.get()
    assert "single" in text and "17.8x" in text and "target" not in text and "True" not in text


def test_the_console_is_wide_when_piped(monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    assert _stdout_console().width >= 200


def test_the_floor_runs_by_default_only_for_a_server_on_another_machine():
    for url in ("http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:8000", "http://0.0.0.0:8000",
                f"http://{socket.gethostname()}:8000"):
        assert server_is_local(url), url
    assert not server_is_local("http://192.0.2.1:8000")  # TEST-NET-1: never this machine
    assert not server_is_local(None)


def test_quick_runs_what_its_help_says():
    quick = _args("--quick")
    assert _default_scenarios(quick) == list(QUICK_SCENARIOS) == ["single", "interleaved"]
    plan = _plan(quick)
    assert (plan.tools, plan.requests, plan.misses, plan.bypass, plan.groups, plan.rounds) == (10, 3, 2, 0, 2, 2)
    assert sum(SCENARIOS[n].planned(plan) for n in QUICK_SCENARIOS) == 9
    assert "restart" not in _default_scenarios(_args()) and "single" in _default_scenarios(_args())


def test_install_hint_names_the_extra(monkeypatch, capsys):
    assert '".[bench]"' in install_hint()  # this is a checkout
    monkeypatch.setitem(sys.modules, "gateway.bench.command", None)  # as if an import of it failed
    assert _run(_args()) == 2
    err = capsys.readouterr().err
    assert "needs the bench extra" in err and '".[bench]"' in err and "'toolkv[bench]'" not in err
