"""The affinity router alone: rendezvous stability when upstreams come and go, the fallback to
the less loaded of two choices, upstreams believed down going last."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.proxy.response_homes import ResponseHomes
from gateway.proxy.routing import AffinityRouter, affinity_key, make_router

URLS = tuple(f"http://10.0.0.{n}:8000" for n in range(1, 6))
KEYS = [affinity_key(f"tenant{n % 3}", f"tg_{n:016x}") for n in range(4000)]


def homes(router: AffinityRouter) -> dict[str, str]:
    return {key: router.route(key, {}).order[0] for key in KEYS}


def test_a_key_always_has_the_same_home_and_keys_spread_evenly():
    router = AffinityRouter(URLS, max_in_flight=4)
    first, again = homes(router), homes(AffinityRouter(tuple(reversed(URLS)), max_in_flight=4))
    assert first == again  # neither the call nor the listed order of upstreams moves a key
    per_upstream = Counter(first.values())
    assert set(per_upstream) == set(URLS)
    assert all(abs(count - len(KEYS) / len(URLS)) < 0.15 * len(KEYS) / len(URLS) for count in per_upstream.values())


def test_adding_an_upstream_moves_only_its_share_and_only_to_it():
    before = homes(AffinityRouter(URLS[:4], max_in_flight=4))
    after = homes(AffinityRouter(URLS, max_in_flight=4))
    moved = [key for key in KEYS if before[key] != after[key]]
    assert all(after[key] == URLS[4] for key in moved)  # no key moves between the old upstreams
    assert abs(len(moved) / len(KEYS) - 1 / 5) < 0.03


def test_removing_an_upstream_moves_only_its_keys_each_to_its_second_choice():
    full = AffinityRouter(URLS, max_in_flight=4)
    smaller = homes(AffinityRouter(URLS[1:], max_in_flight=4))
    for key, home in homes(full).items():
        expected = full.ranking(key)[1] if home == URLS[0] else home
        assert smaller[key] == expected


def test_a_home_over_its_bound_shares_with_the_less_loaded_second_choice():
    router = AffinityRouter(URLS, max_in_flight=2)
    key = KEYS[0]
    home, second = router.ranking(key)[:2]
    assert router.route(key, {home: 1}).order[0] == home  # under the bound: home
    spilled = router.route(key, {home: 2, second: 0})
    assert spilled.reason == "spill" and spilled.order[:2] == (second, home)  # the home is the next to try
    assert router.route(key, {home: 2, second: 2}).order[0] == home  # a tie stays home
    assert router.route(key, {home: 3, second: 2}).order[0] == second
    assert router.route(key, {home: 2, second: 5}).order[0] == home  # the second is busier


def test_a_hot_group_spreads_over_two_upstreams_only():
    router = AffinityRouter(URLS, max_in_flight=1)
    key, load = KEYS[1], Counter[str]()
    for _ in range(10):
        load[router.route(key, load).order[0]] += 1
    assert set(load) == set(router.ranking(key)[:2]) and load.total() == 10


def test_upstreams_believed_down_go_last_in_rank_order():
    router = AffinityRouter(URLS, max_in_flight=4)
    key = KEYS[2]
    ranked = router.ranking(key)
    route = router.route(key, {}, down={ranked[0], ranked[2]})
    assert route.order == (ranked[1], ranked[3], ranked[4], ranked[0], ranked[2])
    assert route.reason == "failover"
    assert router.route(key, {}, down={ranked[3]}).reason == "home"
    everything_down = router.route(key, {}, down=set(URLS))
    assert everything_down.order == ranked  # still tried, best first


def test_a_down_second_choice_takes_no_spill():
    router = AffinityRouter(URLS[:2], max_in_flight=1)
    key = KEYS[3]
    home, second = router.ranking(key)
    assert router.route(key, {home: 5}, down={second}).order == (home, second)


def test_tenants_route_the_same_group_independently():
    router = AffinityRouter(URLS, max_in_flight=4)
    group_homes = {router.route(affinity_key(f"tenant{n}", "tg_same"), {}).order[0] for n in range(40)}
    assert len(group_homes) > 1


def test_a_router_needs_an_upstream():
    with pytest.raises(ValueError, match="at least one upstream"):
        AffinityRouter((), max_in_flight=1)


def test_round_robin_takes_turns_whatever_the_group_and_puts_the_down_last():
    router = make_router(URLS[:3], "round_robin", max_in_flight=4)
    firsts = [router.route(KEYS[0], {}).order[0] for _ in range(6)]
    assert firsts == list(URLS[:3]) * 2  # one group, every upstream in turn: each compiles it
    route = router.route(KEYS[1], {}, down={URLS[0]})
    assert route.order == (URLS[1], URLS[2], URLS[0]) and route.reason == "turn"
    assert isinstance(make_router(URLS, "affinity", max_in_flight=4), AffinityRouter)


def test_response_homes_are_kept_per_tenant_and_bounded_in_all():
    homes = ResponseHomes(capacity=5, per_tenant=3)
    for n in range(4):
        homes.remember("busy", f"resp_{n}", "http://a")
    assert [homes.home("busy", f"resp_{n}") for n in range(4)] == [None, "http://a", "http://a", "http://a"]
    homes.remember("quiet", "resp_q", "http://b")
    assert homes.home("busy", "resp_q") is None and homes.home("quiet", "resp_q") == "http://b"  # per tenant
    homes.remember("other", "resp_o1", "http://b")
    homes.remember("other", "resp_o2", "http://b")  # 6 > 5: the least recently used tenant's oldest goes
    assert len(homes) == 5 and homes.home("busy", "resp_1") is None and homes.home("quiet", "resp_q") == "http://b"
    homes.forget("quiet", "resp_q")
    assert homes.home("quiet", "resp_q") is None and len(homes) == 4
