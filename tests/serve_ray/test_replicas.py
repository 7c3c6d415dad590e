"""`toolkv serve --replicas 2` on a real local Ray instance, through the `openai` SDK at the
ingress: interleaved tool groups each compile once, on their home replica, and hit from then on
(as on one replica; round robin would miss half the time); streams stream."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.proxy.routing import AffinityRouter, affinity_key
from gateway.serve_ray import APP_NAME, engine_name
from tests.proxy.conftest import group_id, messages, metric, tools_of
from tests.serve_ray.conftest import HOT_BOUND, MODEL, REPLICAS
from tests.support.waiting import wait_until

pytest.importorskip("ray.serve")

TOOLS = tools_of([("orders", 30), ("refunds", 12), ("inventory", 20), ("customers", 8)])
SYSTEMS = [f"Shop {n} assistant. Answer briefly." for n in range(4)]
ROUNDS = 4


def client_for(base_url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=300)


def samples(text: str) -> dict[str, float]:
    lines = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in lines}


def replica_metrics(index: int) -> dict[str, float]:
    """A replica's own /metrics, asked through its deployment handle (replicas have no port)."""
    from ray import serve

    handle = serve.get_deployment_handle(engine_name(index), app_name=APP_NAME)
    parts = list(handle.options(stream=True).call.remote("GET", "/metrics", b"", [], b""))
    return samples(b"".join(p for p in parts if isinstance(p, bytes)).decode())


def home(system: str, salt: str = "") -> str:
    router = AffinityRouter([f"http://{engine_name(i)}" for i in range(REPLICAS)], 1)
    return router.ranking(affinity_key(salt, group_id(system, TOOLS)))[0]


def ask(client: openai.OpenAI, system: str, question: str, **extra: Any) -> Any:
    fields: dict[str, Any] = {"tool_choice": "none", "temperature": 0, "max_tokens": 3, **extra}
    return client.chat.completions.create(model=MODEL, messages=messages(system, question), tools=TOOLS, **fields)


def test_interleaved_groups_compile_once_on_their_home_replica_and_hit_after(ingress_url):
    """The fleet is the package's (test_fleet_view.py used it first): counts are what this test added."""
    client = client_for(ingress_url)
    was = samples(httpx.get(ingress_url + "/metrics", timeout=30).text)
    own_was = [replica_metrics(index) for index in range(REPLICAS)]
    for turn in range(ROUNDS):
        for system in SYSTEMS:
            cached = ask(client, system, f"question {turn}").usage.prompt_tokens_details.cached_tokens
            assert (cached > 0) == (turn > 0), (system, turn, cached)

    fleet = samples(httpx.get(ingress_url + "/metrics", timeout=30).text)

    def added(name: str, **labels: str) -> float:
        return metric(fleet, name, **labels) - metric(was, name, **labels)

    assert added("toolkv_cache_lookups_total", result="miss") == len(SYSTEMS)  # the replicas' own
    assert added("toolkv_cache_lookups_total", result="hit") == len(SYSTEMS) * (ROUNDS - 1)
    assert added("toolkv_ingress_cache_lookups_total", result="miss") == len(SYSTEMS)  # as routed
    for index in range(REPLICAS):
        name, url = engine_name(index), f"http://{engine_name(index)}"
        homed = sum(home(system) == url for system in SYSTEMS)
        own_misses = [metric(m, "toolkv_cache_lookups_total", result="miss") for m in (own_was[index],
                                                                                       replica_metrics(index))]
        assert own_misses[1] - own_misses[0] == homed, name  # its compiles
        assert added("toolkv_cache_lookups_total", result="miss", replica=name) == homed, name
        assert added("toolkv_ingress_cache_lookups_total", result="miss", upstream=url) == homed, name
    assert {home(system) for system in SYSTEMS} == {f"http://{engine_name(i)}" for i in range(REPLICAS)}


def test_the_fleets_metrics_are_one_valid_exposition(ingress_url):
    text = httpx.get(ingress_url + "/metrics", timeout=30).text
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))  # each family once, its lines together
    families = {family.name: family for family in text_string_to_metric_families(text)}
    replicas = {s.labels.get("replica") for s in families["toolkv_requests"].samples}
    assert replicas == {engine_name(i) for i in range(REPLICAS)}
    assert "toolkv_upstream_routed" in families and "toolkv_ingress_requests" in families


def test_the_fleets_cache_lists_each_group_on_its_home_replica(ingress_url):
    client = client_for(ingress_url)
    for system in SYSTEMS:
        ask(client, system, "cached?")
    entries = httpx.get(ingress_url + "/v1/cache", timeout=30).json()["data"]
    ram = {(entry["group_id"], entry["replica"]) for entry in entries if "ram" in entry["tiers"]}
    for system in SYSTEMS:
        assert [replica for group, replica in ram if group == group_id(system, TOOLS)] == \
            [home(system).removeprefix("http://")], system


def test_a_stream_arrives_in_chunks_with_its_usage(ingress_url):
    client = client_for(ingress_url)
    system = "Streaming shop assistant."
    ask(client, system, "warm the group")
    chunks = list(ask(client, system, "stream this", stream=True, max_tokens=6,
                      stream_options={"include_usage": True}))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) >= 2  # several content chunks, not one body
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert chunks[-1].usage.completion_tokens == 6


def test_a_stream_reaches_the_client_event_by_event(ingress_url):
    """The ingress relays the replica's events as they are sent, not one body at the end."""
    body = {"model": MODEL, "messages": messages("Relay shop assistant.", "count"), "tools": TOOLS,
            "tool_choice": "none", "temperature": 0, "max_tokens": 24, "stream": True}
    reads: list[bytes] = []
    with httpx.stream("POST", ingress_url + "/v1/chat/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        reads.extend(resp.iter_raw())
    assert len(reads) > 2, reads
    assert reads[0].startswith(b"data: {") and b"[DONE]" not in reads[0]
    assert reads[-1].endswith(b"data: [DONE]\n\n")


def first_event(resp: httpx.Response) -> Iterator[str]:
    """Wait for the stream's first event; keep the returned lines while the stream should stay open."""
    lines = resp.iter_lines()
    assert next(line for line in lines if line.startswith("data: "))
    return lines


def fleet_metrics(base_url: str) -> dict[str, float]:
    return samples(httpx.get(base_url + "/metrics", timeout=30).text)


def test_a_hot_group_spreads_to_its_second_replica_and_hang_ups_stop_every_generation(ingress_url):
    """One stream more than the bound, of one group, at once: the bound's worth stay on the group's
    home, the last goes to its second replica; the clients then hang up, which ends every
    generation on the replicas."""
    system = "You are very popular."
    body = {"model": MODEL, "messages": messages(system, "Write a long story."), "tools": TOOLS,
            "tool_choice": "none", "temperature": 0, "max_tokens": 3000, "stream": True}
    before = fleet_metrics(ingress_url)
    spilled = metric(before, "toolkv_upstream_routed_total", route="spill")
    hung_up = metric(before, "toolkv_requests_total", status="499")
    url = ingress_url + "/v1/chat/completions"
    with contextlib.ExitStack() as streams:  # each in flight (its first event read) before the next is sent
        held = [first_event(streams.enter_context(httpx.stream("POST", url, json=body, timeout=120)))
                for _ in range(HOT_BOUND + 1)]
        during = fleet_metrics(ingress_url)
    del held
    assert metric(during, "toolkv_upstream_routed_total", route="spill") == spilled + 1
    in_flight = {engine_name(i): metric(during, "toolkv_requests_in_flight", replica=engine_name(i))
                 for i in range(REPLICAS)}
    homed = home(system).removeprefix("http://")
    assert in_flight == {name: HOT_BOUND if name == homed else 1 for name in in_flight}
    assert wait_until(lambda: metric(fleet_metrics(ingress_url), "toolkv_requests_in_flight") == 0)
    assert wait_until(lambda: metric(fleet_metrics(ingress_url), "toolkv_requests_total", status="499")
                      == hung_up + HOT_BOUND + 1)


def test_warming_compiles_a_group_on_its_home_replica_only(ingress_url):
    system = "Warmed shop assistant."
    warmed = httpx.post(ingress_url + "/v1/cache/warm", json={"system": system, "tools": TOOLS}, timeout=120)
    assert warmed.status_code == 200, warmed.text
    assert warmed.json()["replica"] == home(system).removeprefix("http://")
    entries = httpx.get(ingress_url + "/v1/cache", timeout=30).json()["data"]
    in_ram = [e["replica"] for e in entries if e["group_id"] == group_id(system, TOOLS) and "ram" in e["tiers"]]
    assert in_ram == [warmed.json()["replica"]]
    assert ask(client_for(ingress_url), system, "first question").usage.prompt_tokens_details.cached_tokens > 0


def test_a_client_that_hangs_up_on_a_whole_answer_stops_its_generation_on_the_replica(ingress_url):
    """Not streamed, the replica's answer comes only when it is done: the ingress, cancelled by the
    hang-up, must cancel its Ray call too, or the replica writes 3,000 tokens for nobody."""
    before = metric(fleet_metrics(ingress_url), "toolkv_requests_total", status="499")
    body = orjson.dumps({"model": MODEL, "messages": messages("You never stop.", "Write a long story."),
                         "tools": TOOLS, "tool_choice": "none", "temperature": 0, "max_tokens": 3000})
    url = httpx.URL(ingress_url)
    with socket.create_connection((url.host, url.port), timeout=30) as raw:
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (url.host.encode(), url.port, len(body), body))
        assert wait_until(lambda: sum(metric(fleet_metrics(ingress_url), "toolkv_requests_in_flight",
                                             replica=engine_name(i)) for i in (0, 1)) == 1)
    assert wait_until(lambda: metric(fleet_metrics(ingress_url), "toolkv_requests_total", status="499") == before + 1)
    assert wait_until(lambda: metric(fleet_metrics(ingress_url), "toolkv_requests_in_flight") == 0)
