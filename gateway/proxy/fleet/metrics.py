"""The fleet's Prometheus series, as the merged metrics show them and the dashboard reads them: every
server's series with a label naming it (`replica` on the Ray ingress, `upstream` in proxy mode;
fleet totals are a `sum without (...)` away, and dashboards written for one gateway keep working
with `sum`), plus the app's own routing series (`toolkv_upstream_*`); its request and cache
series, which would otherwise be counted twice, are renamed with the view's prefix
(`toolkv_ingress_*`, `toolkv_proxy_*`). A server that did not answer, or whose answer is not the
text format, has no series."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from fastapi import Request
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gateway.proxy.fan_out import UpstreamAnswer
from gateway.proxy.fleet.view import ask_members, view_of
from gateway.proxy.state import proxy_state

OWN_KEPT_PREFIXES = ("toolkv_upstream_", "process_")  # the app's series no server has


async def fleet_collector(request: Request, answers: list[UpstreamAnswer] | None = None,
                          label: str | None = None) -> FleetCollector:
    """The app's series and every server's (`answers` to `GET /metrics`: asked here when not given),
    each server's labelled `label` (the view's member by default)."""
    view = view_of(request)
    own = generate_latest(proxy_state(request.app).metrics.registry).decode()
    answers = answers if answers is not None else await ask_members(request, "GET", "/metrics")
    texts = {view.name(a.url): a.body.decode(errors="replace") if a.ok else "" for a in answers}
    return FleetCollector(own, texts, label or view.member, view.own_prefix)


async def fleet_families(request: Request, answers: list[UpstreamAnswer] | None = None,
                         label: str | None = None) -> list[Metric]:
    return list((await fleet_collector(request, answers, label)).collect())


class FleetCollector(Collector):
    def __init__(self, own: str, member_texts: dict[str, str], label: str, own_prefix: str) -> None:
        self.own = own
        self.member_texts = member_texts
        self.label = label
        self.own_prefix = own_prefix

    def collect(self) -> Iterator[Metric]:
        """One family per name (the text format wants each family's lines together)."""
        merged: dict[str, Metric] = {}
        for member, text in self.member_texts.items():
            for family in _families(text):
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                into.samples += [s._replace(labels={**s.labels, self.label: member}) for s in family.samples]
        for family in _families(self.own):
            name = family.name if family.name.startswith(OWN_KEPT_PREFIXES) else self.own_name(family.name)
            into = merged.setdefault(name, Metric(name, family.documentation, family.type))
            into.samples += [s._replace(name=name + s.name.removeprefix(family.name)) for s in family.samples]
        yield from merged.values()

    def own_name(self, name: str) -> str:
        """What the app's own series `name` is called in the merge."""
        return self.own_prefix + name.removeprefix("toolkv_")


def only_member(families: Iterable[Metric], label: str, member: str) -> list[Metric]:
    """The families with only `member`'s samples (those whose `label` names it)."""
    kept = []
    for family in families:
        own = Metric(family.name, family.documentation, family.type)
        own.samples = [s for s in family.samples if s.labels.get(label) == member]
        kept.append(own)
    return kept


def _families(text: str) -> list[Metric]:
    """Parsed families, less `_created` timestamps (the parser splits them off as untyped); none
    from a text that is not Prometheus' format (a foreign upstream's answer)."""
    try:
        return [family for family in text_string_to_metric_families(text)
                if not (family.type == "unknown" and family.name.endswith("_created"))]
    except ValueError:
        return []
