"""A fleet with API keys: each tenant's groups stay its own across the ingress (the replicas
derive the same tenants); and a replica killed mid-run: Ray Serve replaces it under the same
name, its groups stay home and the replacement loads them from the shared cache dir's disk tier
(a hit, no compile); no request fails meanwhile (those sent to it wait for the replacement)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.auth import _salt
from gateway.serve_ray import engine_name
from tests.proxy.conftest import metric
from tests.ray.conftest import ray_fleet, ray_settings
from tests.ray.test_replicas import SYSTEMS, ask, client_for, home, samples

pytest.importorskip("ray.serve")

KEYS = ("tenant-a-key", "tenant-b-key")


@pytest.fixture(scope="module")
def fleet_url(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    settings = ray_settings(tiny_model_dir, tmp_path_factory.mktemp("ray-failover-cache"), api_keys=KEYS)
    with ray_fleet(settings) as base_url:
        yield base_url


def kill_replica(name: str) -> None:
    import ray

    [actor] = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"#{name}#" in a["name"]]
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)


def test_tenants_never_share_a_group_through_the_ingress(fleet_url):
    system = "Tenant shop assistant."
    a, b = (client_for(fleet_url, key) for key in KEYS)
    assert ask(a, system, "one").usage.prompt_tokens_details.cached_tokens == 0
    assert ask(b, system, "one").usage.prompt_tokens_details.cached_tokens == 0  # A's entry is not B's
    assert ask(a, system, "two").usage.prompt_tokens_details.cached_tokens > 0
    assert ask(b, system, "two").usage.prompt_tokens_details.cached_tokens > 0
    with pytest.raises(openai.AuthenticationError):
        ask(client_for(fleet_url, "not-a-key"), system, "three")


def test_a_killed_replicas_groups_reload_from_the_shared_disk_and_no_request_fails(fleet_url):
    client = client_for(fleet_url, KEYS[0])
    for turn in range(2):
        for system in SYSTEMS:
            ask(client, system, f"question {turn}")
    victim = engine_name(0)
    assert any(home(s, _salt(KEYS[0].encode())) == f"http://{victim}" for s in SYSTEMS)
    kill_replica(victim)
    for turn in range(2, 4):
        for system in SYSTEMS:  # the SDK does not retry (max_retries=0): each must succeed at once
            assert ask(client, system, f"question {turn}").usage.prompt_tokens_details.cached_tokens > 0

    fleet = samples(httpx.get(fleet_url + "/metrics", timeout=30).text)
    assert metric(fleet, "toolkv_cache_lookups_total", replica=victim, result="hit", tier="disk") >= 1
    assert metric(fleet, "toolkv_cache_lookups_total", replica=victim, result="miss") == 0  # the replacement's
    assert metric(fleet, "toolkv_ingress_requests_total") == metric(fleet, "toolkv_ingress_requests_total",
                                                                    status="200")
