"""`toolkv serve --replicas 2` (API keys, one shared cache dir) with a group in `pinned_groups` and
shared with every tenant: each replica warmed and pinned it before the fleet said ok, so its first
request is a hit; Anthropic's Messages API through the ingress with the real `anthropic` SDK (its
key sent as `x-api-key`) goes to the group's home replica, hits there, and shares its prefix with
the equivalent chat request (the `openai` SDK); `POST`/`DELETE /v1/cache/{id}/pin` at the ingress
pins and unpins a group on every replica that holds it, and `GET /v1/cache` and the dashboard show
the fleet's pinned groups, bytes and budget. One fleet for the module; tests run in file order."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from gateway.edge.admission import tenant_salt
from gateway.proxy.routing import AffinityRouter, affinity_key
from gateway.serve_ray import engine_name
from tests.proxy.conftest import group_id, messages, metric, tools_of
from tests.serve_ray.conftest import MODEL, REPLICAS, ray_fleet, ray_settings
from tests.serve_ray.test_replicas import client_for, samples

pytest.importorskip("ray.serve")

KEY, ADMIN = "fleet-tenant-key", "fleet-admin-key"
NAMES = [engine_name(i) for i in range(REPLICAS)]
TOOLS = tools_of([("orders", 18), ("refunds", 9)])
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
PINNED_SYSTEM = "You are the pinned desk of the fleet."
BUDGET_BYTES = 32 * 1024**2


@pytest.fixture(scope="module")
def fleet_url(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory,
              serve_port: int) -> Iterator[str]:
    groups = tmp_path_factory.mktemp("groups") / "pinned.json"
    groups.write_text(json.dumps({"system": PINNED_SYSTEM, "tools": TOOLS}))
    settings = ray_settings(tiny_model_dir, tmp_path_factory.mktemp("ray-pins-cache"), port=serve_port, api_keys=(KEY,),
                            admin_key=ADMIN, pinned_groups=(str(groups),), pinned_budget_bytes=BUDGET_BYTES,
                            shared_groups=(group_id(PINNED_SYSTEM, TOOLS),))
    with ray_fleet(settings) as base_url:
        yield base_url


def admin(method: str, base_url: str, path: str) -> httpx.Response:
    body = {} if method == "POST" else None
    return httpx.request(method, base_url + path, json=body, headers={"authorization": f"Bearer {ADMIN}"},
                         timeout=120)


def home(system: str) -> str:
    """The replica a tenant's group goes to (salted by the tenant's key: the group is its own)."""
    router = AffinityRouter([f"http://{name}" for name in NAMES], 1)
    return router.ranking(affinity_key(tenant_salt(KEY.encode()), group_id(system, TOOLS)))[0].removeprefix("http://")


def sdk(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0, timeout=300)  # sent as x-api-key


def ask(base_url: str, system: str, question: str) -> Any:
    return sdk(base_url).messages.create(model=MODEL, max_tokens=3, system=system, tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
                                         tool_choice={"type": "none"},
                                         messages=[{"role": "user", "content": question}])


def misses_on(base_url: str) -> dict[str, float]:
    fleet = samples(httpx.get(base_url + "/metrics", timeout=60).text)
    return {name: metric(fleet, "toolkv_cache_lookups_total", result="miss", replica=name) for name in NAMES}


def test_a_group_in_pinned_groups_is_pinned_on_every_replica_and_hits_from_its_first_request(fleet_url):
    listing = admin("GET", fleet_url, "/v1/cache").json()
    copies = [entry for entry in listing["data"] if entry["group_id"] == group_id(PINNED_SYSTEM, TOOLS)]
    assert sorted(entry["replica"] for entry in copies) == NAMES and all(entry["pinned"] for entry in copies)
    assert (listing["pinned_bytes"], listing["pinned_budget_bytes"]) == (copies[0]["bytes"], BUDGET_BYTES)
    answer = ask(fleet_url, PINNED_SYSTEM, "Hi")
    assert answer.usage.cache_read_input_tokens == copies[0]["prefix_tokens"]


def test_messages_go_to_their_home_replica_hit_there_and_share_the_prefix_with_chat(fleet_url):
    system = "You are the Messages desk of the fleet."
    before = misses_on(fleet_url)
    first = ask(fleet_url, system, "Hi")
    after = misses_on(fleet_url)
    assert [name for name in NAMES if after[name] > before[name]] == [home(system)]
    written = first.usage.cache_creation_input_tokens
    assert first.usage.cache_read_input_tokens == 0 and written > 0
    with sdk(fleet_url).messages.stream(model=MODEL, max_tokens=3, system=system, tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
                                        tool_choice={"type": "none"},
                                        messages=[{"role": "user", "content": "Hey"}]) as stream:
        names = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert streamed.usage.cache_read_input_tokens == written
    chat = client_for(fleet_url, KEY).chat.completions.create(model=MODEL, messages=messages(system, "Hello"),
                                                              tools=TOOLS, tool_choice="none", max_tokens=3)
    assert chat.usage.prompt_tokens_details.cached_tokens == written
    assert misses_on(fleet_url) == after  # no replica compiled the group again


def test_pinning_at_the_ingress_pins_the_group_on_every_replica_holding_it(fleet_url):
    warmed = admin("POST", fleet_url, "/v1/cache/warm")  # an empty body: refused by the replica, passed on
    assert warmed.status_code == 400
    resp = httpx.post(fleet_url + "/v1/cache/warm", json={"system": "You are the pin-me desk.", "tools": TOOLS},
                      headers={"authorization": f"Bearer {ADMIN}"}, timeout=120)
    assert resp.status_code == 200, resp.text
    entry = resp.json()
    pinned = admin("POST", fleet_url, f"/v1/cache/{entry['id']}/pin")
    assert pinned.status_code == 200, pinned.text
    assert pinned.json()["pinned"] is True and sorted(pinned.json()["replicas"]) == NAMES  # its file is shared
    listing = admin("GET", fleet_url, "/v1/cache").json()
    assert all(e["pinned"] for e in listing["data"] if e["id"] == entry["id"])
    pinned_ids = {e["id"]: e["bytes"] for e in listing["data"] if e["pinned"] and "ram" in e["tiers"]}
    assert len(pinned_ids) == 2  # this group and the one in pinned_groups
    assert listing["pinned_bytes"] == sum(pinned_ids.values())  # their KV bytes, in one shared pin file: once

    stats = admin("GET", fleet_url, "/v1/dashboard/stats").json()["pins"]
    assert {(g["id"], g["replica"]) for g in stats["groups"]} == {(i, name) for i in pinned_ids for name in NAMES}
    assert (stats["pinned_bytes"], stats["pinned_budget_bytes"]) == (listing["pinned_bytes"], BUDGET_BYTES)

    unpinned = admin("DELETE", fleet_url, f"/v1/cache/{entry['id']}/pin")
    assert unpinned.status_code == 200 and sorted(unpinned.json()["replicas"]) == NAMES
    assert not any(e["pinned"] for e in admin("GET", fleet_url, "/v1/cache").json()["data"] if e["id"] == entry["id"])


def test_the_ingress_pin_routes_need_the_admin_key_and_a_known_id(fleet_url):
    tenant = httpx.post(fleet_url + "/v1/cache/" + "0" * 64 + "/pin", json={},
                        headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    assert tenant.status_code == 403
    assert admin("POST", fleet_url, "/v1/cache/" + "0" * 64 + "/pin").status_code == 404
    assert admin("DELETE", fleet_url, "/v1/cache/" + "A" * 64 + "/pin").status_code == 400
