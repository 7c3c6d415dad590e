"""The fleet's Prometheus series, as the ingress's `GET /metrics` shows them and its dashboard reads
them: every replica's series with a `replica` label (fleet totals are a `sum without (replica)`
away, and dashboards written for one gateway keep working with `sum`), plus the ingress's own
routing series; its request and cache series, which would otherwise be counted twice, are
renamed `toolkv_ingress_*`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from fastapi import Request
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gateway.serve_ray.fleet_calls import ReplicaAnswer, ask_replicas

OWN_KEPT_PREFIXES = ("toolkv_upstream_", "process_")  # the ingress's series no replica has


async def fleet_collector(request: Request, answers: list[ReplicaAnswer] | None = None) -> FleetCollector:
    """The ingress's series and every replica's (`answers` to `GET /metrics`: asked here when not given)."""
    own = generate_latest(request.app.state.metrics.registry).decode()
    answers = answers if answers is not None else await ask_replicas(request, "GET", "/metrics")
    return FleetCollector(own, {a.replica: a.response.text if a.response is not None and a.status == 200 else ""
                                for a in answers})  # a replica that did not answer has no series


async def fleet_families(request: Request, answers: list[ReplicaAnswer] | None = None) -> list[Metric]:
    return list((await fleet_collector(request, answers)).collect())


class FleetCollector(Collector):
    def __init__(self, own: str, replica_texts: dict[str, str]) -> None:
        self.own = own
        self.replica_texts = replica_texts

    def collect(self) -> Iterator[Metric]:
        """One family per name (the text format wants each family's lines together)."""
        merged: dict[str, Metric] = {}
        for replica, text in self.replica_texts.items():
            for family in _families(text):
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                into.samples += [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]
        for family in _families(self.own):
            name = family.name if family.name.startswith(OWN_KEPT_PREFIXES) else ingress_name(family.name)
            into = merged.setdefault(name, Metric(name, family.documentation, family.type))
            into.samples += [s._replace(name=name + s.name.removeprefix(family.name)) for s in family.samples]
        yield from merged.values()


def ingress_name(name: str) -> str:
    """What the ingress's own series `name` is called in the fleet's view."""
    return "toolkv_ingress_" + name.removeprefix("toolkv_")


def only_replica(families: Iterable[Metric], replica: str) -> list[Metric]:
    """The families with only `replica`'s samples."""
    kept = []
    for family in families:
        own = Metric(family.name, family.documentation, family.type)
        own.samples = [s for s in family.samples if s.labels.get("replica") == replica]
        kept.append(own)
    return kept


def _families(text: str) -> Iterable[Metric]:
    """Parsed families, less `_created` timestamps (the parser splits them off as untyped)."""
    return (family for family in text_string_to_metric_families(text)
            if not (family.type == "unknown" and family.name.endswith("_created")))

