"""Reading a fleet ingress's /metrics (as BenchClient.metrics gives it: {series: value}): the
series' labels, how much a counter grew between two readings per label, the ingress's upstreams
(its replicas), and where requests went and groups compiled between two readings."""

from __future__ import annotations

import re
from typing import Any

ROUTED = "toolkv_upstream_routed_total"  # the ingress's, per upstream and route (home, spill, turn, ...)
UPSTREAM_UP = "toolkv_upstream_up"
LOOKUPS = "toolkv_cache_lookups_total"  # the replicas', each with its `replica` label
Metrics = dict[str, float]


def spread(before: Metrics, after: Metrics) -> dict[str, Any]:
    """Requests per replica and per route, and compiles per replica, between two readings."""
    return {"requests": {replica_name(u): n for u, n in grown(before, after, ROUTED, "upstream").items()},
            "routes": grown(before, after, ROUTED, "route"),
            "compiles": compiles(before, after) if has_replica_series(after) else None}


def compiles(before: Metrics, after: Metrics) -> dict[str, int]:
    return grown(before, after, LOOKUPS, "replica", result="miss")


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def series_labels(series: str) -> tuple[str, dict[str, str]]:
    """`name{a="x",b="y"}` -> (name, {a: x, b: y})."""
    name, _, labels = series.partition("{")
    return name, dict(_LABEL.findall(labels))


def grown(before: Metrics, after: Metrics, name: str, by: str, **match: str) -> dict[str, int]:
    """How much the series `name` with the labels `match` grew, per value of its label `by` (only
    those that grew)."""
    out: dict[str, int] = {}
    for series, value in after.items():
        found, labels = series_labels(series)
        if found == name and by in labels and all(labels.get(k) == v for k, v in match.items()):
            out[labels[by]] = out.get(labels[by], 0) + round(value - before.get(series, 0.0))
    return {key: n for key, n in sorted(out.items()) if n}


def upstreams_of(metrics: Metrics) -> tuple[str, ...]:
    """The ingress's upstreams (replicas), as its `toolkv_upstream_up{upstream}` names them."""
    return tuple(sorted({labels["upstream"] for name, labels in map(series_labels, metrics)
                         if name == UPSTREAM_UP and "upstream" in labels}))


def has_replica_series(metrics: Metrics) -> bool:
    return any("replica" in series_labels(series)[1] for series in metrics)


def replica_name(upstream: str) -> str:
    """`http://engine-0` -> `engine-0` (the replica label the ingress gives its replicas' series)."""
    return upstream.split("://", 1)[-1].rstrip("/")
