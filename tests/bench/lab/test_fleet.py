"""`toolkv bench --scenario fleet` end to end on a real local Ray instance: two Serve applications of
2 replicas each (a tiny random-weight model), the fleet under test at `/` (affinity routing, one
shared cache dir, the spill bound at half the hot clients, as --spawn sets it) and the round-robin
baseline at `/baseline` (a cache dir per replica), measured through their ingresses."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.cli.main import main
from tests.support.server import wait_until_ready

REPLICAS = ("engine-0", "engine-1")
GROUPS, ROUNDS, CLIENTS, REQUESTS_PER_CLIENT = 4, 5, 4, 2  # the quick plan's


@pytest.fixture(scope="module")
def fleets(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Both applications on one Ray instance (4 engines of half a logical CPU); the ingresses' URLs."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from ray.serve.api import RunTarget

    from gateway.serve_ray.deployments import build_application
    from tests.serve_ray.conftest import REPO, ray_settings

    fleet = ray_settings(tiny_model_dir, tmp_path_factory.mktemp("fleet-cache"), upstream_max_in_flight=CLIENTS // 2)
    baseline = ray_settings(tiny_model_dir, tmp_path_factory.mktemp("baseline-cache"), port=fleet.port,
                            upstream_routing="round_robin", replica_cache="separate")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        serve.start(http_options={"host": fleet.host, "port": fleet.port})
        serve.run_many([RunTarget(build_application(fleet, 2, engine_num_cpus=0.5), name="toolkv", route_prefix="/"),
                        RunTarget(build_application(baseline, 2, engine_num_cpus=0.5), name="toolkv-baseline",
                                  route_prefix="/baseline")])
        urls = (f"http://{fleet.host}:{fleet.port}", f"http://{fleet.host}:{fleet.port}/baseline")
        for url in urls:
            assert wait_until_ready(url)["status"] == "ok"
        yield urls
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def bench(fleets: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("fleet-out")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["bench", "--base-url", fleets[0], "--baseline-url", fleets[1], "--lab", "--scenario", "fleet",
                     "--quick", "--tools", "4", "--no-floor", "--out", str(out)])
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


def test_replicas_are_for_a_spawned_fleet(capsys):
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--replicas", "2", "--lab", "--scenario", "fleet"]) == 2
    assert "--replicas N takes --spawn" in capsys.readouterr().err
