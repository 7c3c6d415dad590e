"""Tool-group affinity across upstreams: which upstream a request goes to, and where it goes next
when that one fails. Pure: no I/O, no clock; the caller passes the load and the upstreams it
currently believes down.

Each key (tenant salt + tool-group id) ranks the upstreams by rendezvous hashing (highest random
weight): the weight of (key, upstream) is a hash of both, and the key's home is the upstream with
the highest weight. Adding an upstream moves only the keys whose new weight beats their old home
(1/N of them); removing one moves only its own keys, each to its second choice. A home with
`max_in_flight` requests or more shares with the key's second choice: the request goes to the
less loaded of the two (the home on a tie), so a hot group spreads over two upstreams, both of
which then hold its prefix, instead of over all of them. A request that names a
`prompt_cache_key` is routed by that key (tenant salt + key) instead, as OpenAI routes by it."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Route:
    """The upstreams to try, in order: `order[0]` first, the next after a failure."""

    order: tuple[str, ...]
    reason: Literal["home", "spill", "failover", "turn", "stored"]  # why order[0]: the key's home, its
    # home over the bound (order[0] is the second choice), its home believed down, round robin's
    # turn, or where the Responses answer it continues is stored

    def first(self, upstream: str) -> Route:
        """This route with `upstream` tried first (the rest after it, in their order)."""
        if self.order[0] == upstream or upstream not in self.order:
            return self
        return Route((upstream, *(u for u in self.order if u != upstream)), "stored")


class AffinityRouter:
    def __init__(self, upstreams: Sequence[str], max_in_flight: int) -> None:
        if not upstreams:
            raise ValueError("an affinity router needs at least one upstream")
        self.upstreams = tuple(upstreams)
        self.max_in_flight = max_in_flight

    def ranking(self, key: str) -> tuple[str, ...]:
        """Every upstream, highest weight for `key` first."""
        return tuple(sorted(self.upstreams, key=lambda upstream: -weight(key, upstream)))

    def route(self, key: str, in_flight: Mapping[str, int], down: Collection[str] = ()) -> Route:
        """Where `key`'s request goes. Upstreams believed down keep their rank but go after
        every other (they are still tried when all else fails)."""
        ranked = self.ranking(key)
        order = [u for u in ranked if u not in down] + [u for u in ranked if u in down]
        if len(order) > 1 and order[1] not in down and self._spills(order[0], order[1], in_flight):
            order[0], order[1] = order[1], order[0]
            return Route(tuple(order), "spill")
        return Route(tuple(order), "home" if order[0] == ranked[0] else "failover")

    def _spills(self, home: str, second: str, in_flight: Mapping[str, int]) -> bool:
        home_load = in_flight.get(home, 0)
        return home_load >= self.max_in_flight and in_flight.get(second, 0) < home_load


class RoundRobinRouter:
    """A plain load balancer, whatever the group: each request to the next upstream in turn (those
    believed down last). Not for production: the bench's baseline, showing what affinity saves."""

    def __init__(self, upstreams: Sequence[str]) -> None:
        if not upstreams:
            raise ValueError("a router needs at least one upstream")
        self.upstreams = tuple(upstreams)
        self._turn = itertools.count()

    def ranking(self, key: str) -> tuple[str, ...]:
        return self.upstreams

    def route(self, key: str, in_flight: Mapping[str, int], down: Collection[str] = ()) -> Route:
        start = next(self._turn) % len(self.upstreams)
        turned = self.upstreams[start:] + self.upstreams[:start]
        return Route(tuple([u for u in turned if u not in down] + [u for u in turned if u in down]), "turn")


Router = AffinityRouter | RoundRobinRouter


def make_router(upstreams: Sequence[str], routing: Literal["affinity", "round_robin"], max_in_flight: int) -> Router:
    return RoundRobinRouter(upstreams) if routing == "round_robin" else AffinityRouter(upstreams, max_in_flight)


def weight(key: str, upstream: str) -> int:
    """The rendezvous weight of (`key`, `upstream`): 64 bits of a hash of both."""
    digest = hashlib.blake2b(f"{key}\x00{upstream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def affinity_key(tenant_salt: str, group_id: str) -> str:
    """What requests are routed by: the same group of two tenants may live on two upstreams."""
    return f"{tenant_salt}/{group_id}"


def cache_key_affinity(tenant_salt: str, prompt_cache_key: str) -> str:
    """What a request with a `prompt_cache_key` is routed by instead of its group: requests that
    share the key (a conversation, a user: the client's grouping) share an upstream whatever their
    tools, within the tenant. Group ids start `tg_`/`tp_`, so the two kinds of key never meet."""
    return f"{tenant_salt}/key:{prompt_cache_key}"
