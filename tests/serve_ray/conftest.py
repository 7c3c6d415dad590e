"""A real local Ray instance (2 logical CPUs) running `toolkv serve --replicas 2`'s application
on a tiny random-weight model: two engine replicas sharing one cache dir behind the ingress, on a
free port on 127.0.0.1. Ray and Serve start once for the package (`serve_port`: ~20 s of a quiet
machine's 2 cores each time); each module's fleet is an application deployed on them and deleted
after the module (its replicas' processes with it), so no module sees another's engines or cache.
`ingress_url` is one such fleet shared by test_fleet_view.py, test_lab_fleet.py and
test_replicas.py, whose tests measure what they change; it is deployed when the first of them
runs, so the modules that deploy fleets of their own come before them (file order)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gateway.serve_ray import APP_NAME
from gateway.settings import Settings, load_settings
from tests.support.server import free_port, wait_until_ready

MODEL = "tiny-llama"
REPLICAS = 2
HOT_BOUND = 2  # the package fleet's upstream_max_in_flight
REPO = Path(__file__).resolve().parents[2]


def ray_settings(tiny_model_dir: Callable[..., Path], cache_dir: Path, **overrides: Any) -> Settings:
    return load_settings(overrides={"model": str(tiny_model_dir("llama")), "min_prefix_tokens": 8,
                                    "served_model_name": MODEL, "max_queue": 16, "host": "127.0.0.1",
                                    "port": free_port(), "replicas": REPLICAS, "cache_dir": str(cache_dir),
                                    "ram_budget_bytes": 64 * 1024**2, **overrides}, environ={})


@pytest.fixture(scope="package")
def serve_port() -> Iterator[int]:
    """A fresh local Ray instance with Serve's HTTP proxy on a free port of 127.0.0.1 (that port)."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    port = free_port()
    # address="local": never the (possibly dead) cluster a past `ray start --head` recorded in /tmp/ray
    ray.init(address="local", num_cpus=REPLICAS, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


@contextmanager
def ray_fleet(settings: Settings, app: str = APP_NAME, route_prefix: str = "/",
              engine_num_cpus: float = 1.0) -> Iterator[str]:
    """The application on the package's Ray instance (`settings.port` is `serve_port`); yields the
    ingress's base URL, and deletes the application (replicas and ingress) after."""
    serve = pytest.importorskip("ray.serve")
    from gateway.serve_ray.deployments import build_application

    # serve.run would replace a running app of that name (a package fleet another module still uses)
    assert app not in serve.status().applications, f"the application {app!r} is already deployed"
    try:
        serve.run(build_application(settings, settings.replicas, engine_num_cpus), name=app, route_prefix=route_prefix)
        base_url = f"http://{settings.host}:{settings.port}{route_prefix.rstrip('/')}"
        wait_until_ready(base_url)
        yield base_url
    finally:
        serve.delete(app)


@pytest.fixture(scope="package")
def ingress_url(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory,
                serve_port: int) -> Iterator[str]:
    """The bound is 2, half the bench's hot clients (as `toolkv bench --spawn` sets it): a group's
    third stream at once goes to its second replica."""
    settings = ray_settings(tiny_model_dir, tmp_path_factory.mktemp("ray-cache"), port=serve_port,
                            upstream_max_in_flight=HOT_BOUND)
    with ray_fleet(settings) as base_url:
        yield base_url
