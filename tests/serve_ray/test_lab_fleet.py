"""`toolkv bench --lab --scenario fleet` end to end on the package's Ray instance (conftest.py): the
fleet under test is the package's (`ingress_url`: 2 replicas of a tiny random-weight model,
affinity routing, one shared cache dir, the spill bound at half the hot clients, as --spawn sets
it), at `/`; the round-robin baseline (a cache dir per replica) is a second application, at
`/baseline`, for this module. Both are measured through their ingresses. The bench counts from the
growth of /metrics, on groups of its own, so what other modules did on the fleet does not show.
Here rather than in tests/bench/lab/ to share that Ray instance and fleet: one Ray start and two
engines fewer."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.cli.main import main
from tests.serve_ray.conftest import HOT_BOUND, ray_fleet, ray_settings

pytest.importorskip("ray.serve")

REPLICAS = ("engine-0", "engine-1")
GROUPS, ROUNDS, CLIENTS, REQUESTS_PER_CLIENT = 4, 5, 4, 2  # the quick plan's
BASELINE_APP = "toolkv-baseline"


@pytest.fixture(scope="module")
def baseline_url(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory,
                 serve_port: int) -> Iterator[str]:
    """No logical CPU for its engines: the package fleet's hold the instance's two."""
    settings = ray_settings(tiny_model_dir, tmp_path_factory.mktemp("baseline-cache"), port=serve_port,
                            upstream_routing="round_robin", replica_cache="separate")
    with ray_fleet(settings, BASELINE_APP, "/baseline", engine_num_cpus=0) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def bench(ingress_url: str, baseline_url: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    assert HOT_BOUND == CLIENTS // 2  # what --spawn would set
    out = tmp_path_factory.mktemp("fleet-out")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["bench", "--base-url", ingress_url, "--baseline-url", baseline_url, "--lab", "--scenario",
                     "fleet", "--quick", "--tools", "4", "--no-floor", "--out", str(out)])
    assert code == 0
    return json.loads((out / "bench.json").read_text()), printed.getvalue()
def test_interleaved_groups_hit_after_their_first_request_and_compile_once_on_one_replica(bench):
    report, _ = bench
    fleet = report["scenarios"]["fleet"]
    assert fleet["skipped"] is None and fleet["errors"] == 0 and fleet["replicas"] == list(REPLICAS)
    inter = fleet["interleaved"]
    assert inter["requests"] == GROUPS * ROUNDS and inter["order"] == "ABCDBCDACDABDABCABCD"
    assert inter["after_first"] == {"n": GROUPS * (ROUNDS - 1), "hits": GROUPS * (ROUNDS - 1), "hit_rate": 1.0}
    for label, group in inter["by_group"].items():
        assert group["sequence"] == ["miss"] + ["hit"] * (ROUNDS - 1), label
        [home] = group["first_compiled_on"]
        assert group["compiles"] == {home: 1} and group["routed"] == {home: ROUNDS}, label  # it stays home
    assert sum(inter["compiles"].values()) == GROUPS
    assert report["targets"]["fleet_hits_after_first"] is True
    assert report["targets"]["fleet_first_compile_on_one_replica"] is True


def test_the_hot_group_reaches_both_replicas_and_only_hits_after_warming(bench):
    report, _ = bench
    fleet = report["scenarios"]["fleet"]
    hot = fleet["hot"]
    assert hot["warm"]["routes"] == {"home": CLIENTS // 2, "spill": CLIENTS // 2}  # all four in flight at once
    assert set(hot["measure"]["requests"]) == set(REPLICAS) and hot["measure"]["routes"].get("spill", 0) > 0
    assert hot["n"] == hot["hits"] == CLIENTS * REQUESTS_PER_CLIENT
    assert hot["measure"]["compiles"] == {}  # both replicas held the group after the warming round
    assert hot["replicas_reached"] == list(REPLICAS)
    assert report["targets"]["fleet_hot_spreads"] is True


def test_the_balanced_groups_go_to_their_predicted_homes_split_evenly(bench):
    report, _ = bench
    balanced = report["scenarios"]["fleet"]["balanced"]
    homes = balanced["homes"]
    assert sorted(homes.values()) == sorted(REPLICAS * (CLIENTS // 2))
    assert balanced["warm_routed_to"] == {label: [home] for label, home in homes.items()}
    assert balanced["n"] == balanced["hits"] == CLIENTS * REQUESTS_PER_CLIENT
    ratio = report["scenarios"]["fleet"]["hot_over_balanced_p95"]
    assert ratio == pytest.approx(report["scenarios"]["fleet"]["hot"]["hit_ttft_ms"]["p95"]
                                  / balanced["hit_ttft_ms"]["p95"], rel=0.01)
    assert report["targets"]["fleet_hot_p95_within_2x_balanced"] is (ratio <= 2.0)


def test_the_round_robin_baseline_compiles_every_group_on_both_replicas(bench):
    report, _ = bench
    base = report["scenarios"]["fleet"]["baseline"]
    assert base["skipped"] is None and base["routes"] == {"turn": GROUPS * ROUNDS}
    assert base["compiles"] == dict.fromkeys(REPLICAS, GROUPS)  # each group once per replica: rounds 0 and 1
    assert base["groups_compiled_on_several"] == GROUPS
    assert base["after_first"]["hit_rate"] == (ROUNDS - 2) / (ROUNDS - 1)  # 75%, where affinity gives 100%


def test_the_printed_report_has_the_fleet_table_and_lines(bench):
    printed = " ".join(bench[1].split())  # as wrapped at the console's width
    assert "fleet: 2 replicas behind one ingress" in printed
    assert "fleet interleaved (4 groups x 5 rounds, 2 replicas): 16/16 requests after a group's first hit" in printed
    assert "fleet baseline (the deployment at --baseline-url; routes turn 20): 12/16" in printed
    assert "fleet_hot_spreads" not in printed  # targets are printed only with --check
