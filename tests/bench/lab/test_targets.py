"""The lab's targets, checks and floor on hand-made reports: one table of targets, each met, missed
or not measured; the line each check prints; the floor's pairing and where it runs."""

from __future__ import annotations

import argparse
import socket

import pytest

from gateway.bench.client import Sample
from gateway.bench.context import ScenarioResult
from gateway.bench.lab.command import LabSuite
from gateway.bench.lab.floor import FloorResult, server_is_local
from gateway.bench.lab.floor_report import floor_dict
from gateway.bench.lab.plan import LabPlan
from gateway.bench.lab.targets import TARGETS, check_lines, checks, targets
from gateway.bench.options import register
from gateway.bench.report import block, build_report

FLEET_UNMEASURED = dict.fromkeys(("fleet_hits_after_first", "fleet_first_compile_on_one_replica", "fleet_hot_spreads",
                                  "fleet_hot_p95_within_2x_balanced"))
HOSTILE_UNMEASURED = dict.fromkeys(("hostile_b_within_2x", "hostile_rss_bounded", "hostile_no_5xx"))


def sample(ttft_s: float, cached: int | None, *, bypass: bool = False, expected: str = "any",
           offset: int = 0) -> Sample:
    return Sample("single", "main", 20, offset, expected, bypass, 0.0, ttft_s=ttft_s, total_s=ttft_s + 0.7,
                  prompt_tokens=3000, cached_tokens=cached, completion_tokens=8)


def _targets(scenarios: dict, floors: dict | None = None) -> dict:
    return targets({"scenarios": scenarios, "floor": {"by_tools": floors or {}}})


def _lab_report(result: ScenarioResult, floors: dict[int, FloorResult], *, shares_cpu: bool) -> dict:
    """The report as the lab finishes it, its floor measured beside the server or not."""
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["bench", "--lab", "--base-url", "http://127.0.0.1:1"])
    suite = LabSuite(args, LabPlan.of(args), None)
    suite.floors, suite.shares_cpu = floors, shares_cpu
    report = build_report({}, [result], suite.scenarios, suite.probe_floors())
    suite.finish(report)
    return report


def test_speedup_floor_and_overhead():
    samples = [sample(8.0, 0), sample(10.0, 0), sample(0.40, 2990), sample(0.50, 2990), sample(0.45, 2990),
               sample(9.0, 0, bypass=True), sample(5.0, 2990, offset=20)]  # another slice: not in the overhead
    floor = FloorResult("main", 20, 2990, 30, 8.0, (400.0, 420.0, 440.0), (1.0,), (5.0,), (425.0,))
    out = block(samples, {20: floor.floor_ms})
    assert out["classes"]["miss"]["ttft_ms"] == {"p50": 9000.0, "p95": 9900.0}
    assert out["classes"]["hit"]["n"] == 4 and out["classes"]["bypass"]["n"] == 1
    assert out["speedup"] == pytest.approx(9000.0 / out["classes"]["hit"]["ttft_ms"]["p50"], rel=0.01)
    assert out["floor_ms_p50"] == 420.0
    assert out["hit_overhead_ms"] == pytest.approx(450.0 - 420.0)
    assert out["classes"]["hit"]["decode_tokens_per_s_p50"] == pytest.approx(7 / 0.7)


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
    assert _targets({"single": single}, paired_probe)["hit_overhead_under_20ms"] is True


def test_targets_are_unknown_when_not_measured():
    assert _targets({}) == {"hit_speedup_at_least_15x": None, "hit_overhead_under_20ms": None,
                           "first_request_at_most_2x_a_later_miss": None, "interleaved_every_repeat_hits": None,
                           "restart_at_least_10x_faster": None,
                           "tokens_per_s_4_clients_at_least_2_5x": None, "hit_ttft_4_clients_at_most_2x": None,
                           "hit_ttft_during_compile_at_most_4x": None, "rss_flat_over_soak": None,
                           "agent_computes_only_new_messages": None, "history_rss_flat": None,
                           "constrained_all_valid": None, "constraint_cost_at_most_10pct_of_decode": None,
                           **FLEET_UNMEASURED, **HOSTILE_UNMEASURED}
    assert _targets({"soak": {"rss_first_mb": 1276.0, "rss_growth_mb": 30.0}})["rss_flat_over_soak"] is True
    assert _targets({"soak": {"rss_first_mb": 1276.0, "rss_growth_mb": 200.0}})["rss_flat_over_soak"] is False
    quick = {"speedup": 13.1, "samples": [{"num_tools": 10}]}  # --quick: a 10-tool group's miss is cheaper
    assert _targets({"single": quick})["hit_speedup_at_least_15x"] is None
    assert _targets({"single": {**quick, "samples": [{"num_tools": 20}]}})["hit_speedup_at_least_15x"] is False
    first = "first_request_at_most_2x_a_later_miss"
    assert _targets({"single": {"first_over_later_miss": 1.3, "first_after_start": True}})[first] is True
    assert _targets({"single": {"first_over_later_miss": 3.1, "first_after_start": True}})[first] is False
    assert _targets({"single": {"first_over_later_miss": 1.3, "first_after_start": False}})[first] is None
    measured = _targets({"single": {"speedup": 22.0, "hit_overhead_ms": 12.0},
                        "interleaved": {"every_repeat_hit": True},
                        "restart": {"skipped": None, "first_after_restart": "miss", "restart_speedup": 1.1}})
    assert measured == {"hit_speedup_at_least_15x": True, "hit_overhead_under_20ms": True,
                        "first_request_at_most_2x_a_later_miss": None, "interleaved_every_repeat_hits": True,
                        "restart_at_least_10x_faster": False,
                        "tokens_per_s_4_clients_at_least_2_5x": None, "hit_ttft_4_clients_at_most_2x": None,
                        "hit_ttft_during_compile_at_most_4x": None, "rss_flat_over_soak": None,
                        "agent_computes_only_new_messages": None, "history_rss_flat": None,
                        "constrained_all_valid": None, "constraint_cost_at_most_10pct_of_decode": None,
                        **FLEET_UNMEASURED, **HOSTILE_UNMEASURED}


def _floor(floor_ms: tuple[float, ...], http_ms: tuple[float | None, ...]) -> FloorResult:
    return FloorResult("main", 20, 2990, 30, 8.0, floor_ms, (0.0,) * len(floor_ms), (2.0,) * len(floor_ms),
                       floor_ms, http_ttft_ms=http_ms)


def test_a_floor_slower_than_its_hit_gives_no_overhead_not_a_negative_one():
    out = floor_dict(_floor((4900.0, 400.0, 410.0), (470.0, 430.0, None)), shares_cpu=True)
    assert out["paired_overhead_ms"]["p50"] == 30.0 and out["negative_pairs"] == 1 and out["shares_cpu"] is True
    assert floor_dict(_floor((4900.0,), (470.0,)))["paired_overhead_ms"] == {"p50": None, "p95": None}
    busy = block([sample(8.0, 0), sample(0.47, 2990)], {20: (4900.0,)})
    assert busy["floor_ms_p50"] == 4900.0 and busy["hit_overhead_ms"] is None  # probe floor above the hit


def test_a_floor_beside_the_server_is_labelled_and_never_stands_in_for_the_overhead():
    result = ScenarioResult("single", samples=[sample(8.0, 0), sample(0.45, 2990), sample(0.46, 2990)])
    floors = {20: _floor((300.0, 310.0, 320.0), (450.0, 460.0, 455.0))}
    shared = _lab_report(result, floors, shares_cpu=True)
    assert shared["floor"]["note"] == "unreliable: shares the CPU with the server"
    assert "hit_overhead_ms" not in shared["scenarios"]["single"]  # the probe's floor is not used
    assert shared["targets"]["hit_overhead_under_20ms"] is None
    remote = _lab_report(result, floors, shares_cpu=False)
    assert remote["floor"]["note"] is None and remote["scenarios"]["single"]["hit_overhead_ms"] == 145.0
    assert remote["targets"]["hit_overhead_under_20ms"] is False  # the probe's pairing: 145 ms


def test_checks_say_what_was_measured_and_which_targets_were_missed():
    report = {"scenarios": {"single": {"speedup": 9.5, "hit_overhead_ms": 12.0},
                            "soak": {"rss_first_mb": 1276.0, "rss_growth_mb": 200.0}}, "floor": {"by_tools": {}}}
    found = {c.name: c for c in checks(report)}
    assert len(found) == len(TARGETS) == 20
    assert found["hit_speedup_at_least_15x"].result == "missed"
    assert "9.50x" in found["hit_speedup_at_least_15x"].line and ">= 15x" in found["hit_speedup_at_least_15x"].line
    assert found["hit_overhead_under_20ms"].result == "ok" and "+12.0 ms" in found["hit_overhead_under_20ms"].line
    assert found["rss_flat_over_soak"].result == "missed" and "+15.7%" in found["rss_flat_over_soak"].line
    assert found["restart_at_least_10x_faster"].result == "not measured"
    lines = check_lines(list(found.values()))
    assert lines[0] == "check: 2 of 3 measured targets missed (17 not measured by this run's scenarios)"
    assert lines[1].startswith("  MISSED hit_speedup_at_least_15x: ") and len(lines) == 4


def test_every_target_says_what_it_measured():
    hostile = {"b_ratio_p50": 1.4, "rss_start_mb": 1000.0, "rss_growth_mb": 300.0, "hostile_failures": 0,
               "b_errors": 0}
    report = {"scenarios": {"hostile-soak": hostile}, "floor": {"by_tools": {}}}
    found = {c.name: c for c in checks(report)}
    assert [c.name for c in found.values()] == [t.name for t in TARGETS] == list(targets(report))
    assert all(c.line.startswith(t.measures) and c.line.endswith(f"(target {t.threshold})")
               for c, t in zip(found.values(), TARGETS, strict=True))
    rss = found["hostile_rss_bounded"]
    assert rss.result == "missed" and "+30.0% of 1,000 MB" in rss.line
    assert found["hostile_b_within_2x"].result == "ok" and found["hostile_no_5xx"].result == "ok"


def test_the_floor_runs_by_default_only_for_a_server_on_another_machine():
    for url in ("http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:8000", "http://0.0.0.0:8000",
                f"http://{socket.gethostname()}:8000"):
        assert server_is_local(url), url
    assert not server_is_local("http://192.0.2.1:8000")  # TEST-NET-1: never this machine
    assert not server_is_local(None)
