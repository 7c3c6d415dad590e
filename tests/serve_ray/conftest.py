"""A real local Ray instance (2 logical CPUs) running `toolkv serve --replicas 2`'s application
on a tiny random-weight model: two engine replicas sharing one cache dir behind the ingress, on a
free port on 127.0.0.1. Ray and Serve are shut down after each module."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gateway.settings import Settings, load_settings
from tests.support.server import free_port, wait_until_ready

MODEL = "tiny-llama"
REPLICAS = 2
REPO = Path(__file__).resolve().parents[2]


def ray_settings(tiny_model_dir: Callable[..., Path], cache_dir: Path, **overrides: Any) -> Settings:
    return load_settings(overrides={"model": str(tiny_model_dir("llama")), "min_prefix_tokens": 8,
                                    "served_model_name": MODEL, "max_queue": 16, "host": "127.0.0.1",
                                    "port": free_port(), "replicas": REPLICAS, "cache_dir": str(cache_dir),
                                    "ram_budget_bytes": 64 * 1024**2, **overrides}, environ={})


@contextmanager
def ray_fleet(settings: Settings) -> Iterator[str]:
    """The application on a fresh local Ray instance; yields the ingress's base URL."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from gateway.serve_ray import APP_NAME
    from gateway.serve_ray.deployments import build_application

    # address="local": never the (possibly dead) cluster a past `ray start --head` recorded in /tmp/ray
    ray.init(address="local", num_cpus=REPLICAS, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        serve.run(build_application(settings, settings.replicas), name=APP_NAME, route_prefix="/")
        base_url = f"http://{settings.host}:{settings.port}"
        wait_until_ready(base_url)
        yield base_url
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def ingress_url(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The bound is 1 so that two streams of one group at once spread over both replicas."""
    settings = ray_settings(tiny_model_dir, tmp_path_factory.mktemp("ray-cache"), upstream_max_in_flight=1)
    with ray_fleet(settings) as base_url:
        yield base_url
