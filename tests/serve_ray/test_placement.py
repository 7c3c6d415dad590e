"""Where engine replicas run: Ray hides GPUs from an actor that reserves none, so an engine meant
for CUDA must reserve one (or a share), and one for the CPU none; the application carries it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings import load_settings

pytest.importorskip("ray.serve")

from gateway.serve_ray.deployments import app_builder, build_application, engine_num_gpus


@pytest.mark.parametrize(("device", "cluster_gpus", "replicas", "each"), [
    ("auto", 0, 2, 0.0),   # this machine: CPU engines
    ("cpu", 4, 2, 0.0),    # asked for the CPU on a GPU cluster
    ("auto", 4, 2, 1.0),   # a GPU per engine
    ("cuda", 2, 2, 1.0),
    ("cuda", 1, 2, 0.5),   # two engines share the one GPU
    ("auto", 1, 3, 0.3333),
])
def test_each_engine_reserves_a_gpu_when_it_is_meant_to_use_one(device, cluster_gpus, replicas, each):
    assert engine_num_gpus(device, cluster_gpus, replicas) == each


def test_cuda_on_a_cluster_without_gpus_is_refused():
    with pytest.raises(ValueError, match="no GPU"):
        engine_num_gpus("cuda", 0, 2)


def engines_options(application) -> list[dict]:
    ingress = application._bound_deployment
    return [arg._bound_deployment.ray_actor_options for arg in ingress.init_args[1:]]


def test_the_application_reserves_what_it_was_given(tmp_path: Path):
    settings = load_settings(overrides={"cache_dir": str(tmp_path)}, environ={})
    options = engines_options(build_application(settings, 2, engine_num_cpus=2, engine_num_gpus=1))
    assert [(o["num_cpus"], o["num_gpus"]) for o in options] == [(2, 1), (2, 1)]
    from_config = engines_options(app_builder({"replicas": 3, "engine_num_gpus": 0.5, "cache_dir": str(tmp_path)}))
    assert [o["num_gpus"] for o in from_config] == [0.5, 0.5, 0.5]
