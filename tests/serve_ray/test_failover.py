"""A fleet with API keys and a cache dir per replica (`replica_cache = "separate"`, as on separate
nodes): each tenant's groups stay its own across the ingress (the replicas derive the same
tenants); and a replica killed mid-run: the ingress's watch sees it gone, its groups move to the
other replica (a miss, then hits), no request fails, and once Ray Serve's replacement (under the
same name) answers, they go home and load from its cache dir's disk tier."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.edge.admission import _salt
from gateway.serve_ray import engine_name
from tests.proxy.conftest import metric
from tests.serve_ray.conftest import ray_fleet, ray_settings
from tests.serve_ray.test_replicas import SYSTEMS, ask, client_for, home, samples
from tests.support.waiting import wait_until

pytest.importorskip("ray.serve")

KEYS = ("tenant-a-key", "tenant-b-key")
ADMIN = "fleet-admin-key"


@pytest.fixture(scope="module")
def fleet_url(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory,
              serve_port: int) -> Iterator[str]:
    settings = ray_settings(tiny_model_dir, tmp_path_factory.mktemp("ray-failover-cache"), port=serve_port,
                            api_keys=KEYS, admin_key=ADMIN, replica_cache="separate", upstream_probe_s=0.5)
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


def test_the_fleets_operator_routes_need_the_admin_key(fleet_url):
    """Every tenant's tool names and entries are behind the admin key at the ingress, as on a gateway."""
    routes = [("GET", "/v1/cache"), ("DELETE", "/v1/cache"), ("GET", "/v1/dashboard/stats"),
              ("POST", "/v1/cache/warm")]
    for method, path in routes:
        for key, status in ((None, 401), (KEYS[0], 403)):
            headers = {"authorization": f"Bearer {key}"} if key else {}
            resp = httpx.request(method, fleet_url + path, headers=headers, json={} if method == "POST" else None,
                                 timeout=30)
            assert resp.status_code == status, (method, path, key, resp.text)
            assert resp.json()["error"]["type"] in ("invalid_request_error", "authentication_error",
                                                    "permission_error"), resp.text
    admin = httpx.get(fleet_url + "/v1/dashboard/stats", headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert admin.status_code == 200


def replica_up(base_url: str, name: str) -> bool:
    """Whether the ingress's /health (which probes every replica) says replica `name` serves."""
    body = httpx.get(base_url + "/health", timeout=30).json()
    entries = body.get("replicas") or body.get("upstreams") or []
    [entry] = [e for e in entries if name in (e.get("name"), httpx.URL(e.get("url", "http://x")).host)]
    return bool(entry["status"] == "ok")


def test_a_killed_replicas_groups_move_to_the_other_replica_then_come_home(fleet_url):
    client = client_for(fleet_url, KEYS[0])
    salt = _salt(KEYS[0].encode())
    for turn in range(2):
        for system in SYSTEMS:
            ask(client, system, f"question {turn}")
    victim = engine_name(0)
    moved = [s for s in SYSTEMS if home(s, salt) == f"http://{victim}"]
    assert moved and len(moved) < len(SYSTEMS)
    kill_replica(victim)
    assert wait_until(lambda: not replica_up(fleet_url, victim), timeout_s=60)  # the ingress's watch saw it

    for turn in range(2, 4):  # its groups compile once on the survivor (its own cache dir), then hit there
        for system in SYSTEMS:  # the SDK does not retry (max_retries=0): each must succeed at once
            cached = ask(client, system, f"question {turn}").usage.prompt_tokens_details.cached_tokens
            assert (cached > 0) == (turn == 3 or system not in moved), (system, turn, cached)
    survivor = samples(httpx.get(fleet_url + "/metrics", timeout=30).text)
    assert metric(survivor, "toolkv_upstream_routed_total", upstream=f"http://{engine_name(1)}",
                  route="failover") == 2 * len(moved)

    assert wait_until(lambda: replica_up(fleet_url, victim), timeout_s=240)  # Ray Serve's replacement
    for system in SYSTEMS:  # back home: the replacement loads them from its cache dir's disk tier
        assert ask(client, system, "question 4").usage.prompt_tokens_details.cached_tokens > 0
    fleet = samples(httpx.get(fleet_url + "/metrics", timeout=30).text)
    assert metric(fleet, "toolkv_cache_lookups_total", replica=victim, result="hit", tier="disk") == len(moved)
    assert metric(fleet, "toolkv_cache_lookups_total", replica=victim, result="miss") == 0  # the replacement's
    assert metric(fleet, "toolkv_ingress_requests_total") == metric(fleet, "toolkv_ingress_requests_total",
                                                                    status="200")
