"""Which retained entries the retention budget protects: a share per tenant, not a priority over
other tenants. A request's `prompt_cache_retention: "24h"` is a maximum retention, as OpenAI
documents it: it lets its group outlive LRU pressure only within `retained_budget_bytes`, split
between the tenants that hold retentions by max-min fairness (a tenant asking for less than an
equal split keeps all of it; what it leaves over is split among the others). Within its share a
tenant keeps its most recently retained groups first (the latest deadlines); the rest of its
retentions protect nothing, so a tenant that floods loses its own retentions first, and another
tenant's group is never evicted to keep them.

Pure functions of the holds: no clock, no I/O (the eviction order is tested without a model,
tests/kvcache/test_retention_shares.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Retained:
    """One live retention: whose, until when, and the entry's bytes (0 while not yet computed)."""

    digest: str
    tenant: str
    retain_until: float
    num_bytes: int


def fair_shares(demands: Mapping[str, int], budget_bytes: int) -> dict[str, int]:
    """Max-min fair split of `budget_bytes`: each tenant gets its demand or an equal split of what
    is left, whichever is smaller, smallest demands first."""
    shares: dict[str, int] = {}
    left, waiting = budget_bytes, len(demands)
    for tenant, demand in sorted(demands.items(), key=lambda item: (item[1], item[0])):
        shares[tenant] = min(demand, left // waiting)
        left -= shares[tenant]
        waiting -= 1
    return shares


def protected(retained: list[Retained], budget_bytes: int) -> set[str]:
    """The digests whose retention holds: per tenant, newest deadline first, as many as fit its
    fair share (the first that does not fit ends the tenant's run, so a share never skips to an
    older, smaller retention)."""
    by_tenant: dict[str, list[Retained]] = {}
    for hold in retained:
        by_tenant.setdefault(hold.tenant, []).append(hold)
    shares = fair_shares({t: sum(h.num_bytes for h in held) for t, held in by_tenant.items()}, budget_bytes)
    kept: set[str] = set()
    for tenant, held in by_tenant.items():
        room = shares[tenant]
        for hold in sorted(held, key=lambda h: (-h.retain_until, h.digest)):
            if hold.num_bytes > room:
                break
            room -= hold.num_bytes
            kept.add(hold.digest)
    return kept
