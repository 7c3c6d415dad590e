"""The live dashboard: the page at `/` and its assets, served from `gateway/api/static/` (no CDN), and
`GET /v1/dashboard/stats`, the numbers the page polls. Everything is read from the app's Prometheus
registry (after `Runtime.refresh_gauges` has taken the engine's stats snapshot), from that snapshot's
RAM listing and from the pins; the serving layer knows nothing about the dashboard. The numbers are
computed from collected metric families, so the Ray Serve ingress computes the fleet's from its
replicas' merged series with the same functions (`gateway/proxy/fleet/`, handed this module when the
app is built)."""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse
from prometheus_client.metrics_core import Metric

from gateway.api.state import gateway_state
from gateway.errors import NotFound
from gateway.metrics import EngineView

if TYPE_CHECKING:
    from gateway.api.state import GatewayState
    from gateway.kvcache.store import EntryInfo
    from gateway.serving.runtime import Runtime

STATIC_DIR = Path(__file__).resolve().parent / "static"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
TTFT_LABELS = ("hit", "miss", "bypass")
TTFT_HISTOGRAM = "toolkv_time_to_first_token_seconds"
TTFT_MAX = "toolkv_time_to_first_token_max_seconds"  # the slowest since start (a gauge)
MAX_GROUP_ROWS = 200

page_router = APIRouter(include_in_schema=False)  # the page and its assets: no data, any app may serve them
router = APIRouter(include_in_schema=False)


class Collectable(Protocol):
    """A metric or a registry: what `collect()` gives is a list of families."""

    def collect(self) -> Iterable[Metric]: ...


@dataclass(frozen=True, slots=True)
class CollectedFamilies:
    """Families collected once, read again as a `Collectable`."""

    families: Sequence[Metric]

    def collect(self) -> Iterable[Metric]:
        return self.families


@page_router.get("/")
async def index() -> FileResponse:
    return _asset("index.html")


@page_router.get("/static/{name}")
async def static_asset(name: str) -> FileResponse:
    return _asset(name)


router.include_router(page_router)


@router.get("/v1/dashboard/stats")
async def stats(request: Request) -> JSONResponse:
    state = gateway_state(request.app)
    state.keyring.admin(request)  # tool names of every tenant: admin only once keys are configured
    runtime = state.model.runtime
    listing: tuple[EntryInfo, ...] = ()
    if runtime is not None:
        await runtime.refresh_gauges_off_loop()
        snapshot = await runtime.snapshot()  # the RAM tier now, as the engine's thread sees it
        listing = snapshot.store.listing if snapshot is not None else ()
    metrics = state.metrics
    families = list(metrics.registry.collect())
    windows = state.ttft_windows
    windows.sample(CollectedFamilies(families), time.time())  # the TTFT histogram and its slowest
    points = windows.to_json()
    return JSONResponse({
        "status": state.model.status, "model": runtime.model_name if runtime is not None else None,
        "totals": totals(families), "engine": engine(families, metrics.engine) if runtime is not None else None,
        "ttft_windows": points, "ttft_ceiling_ms": ttft_ceiling_ms(points), "window_s": windows.window_s,
        "groups": ram_groups(listing), "pins": await pins(state, runtime, listing)})


def _asset(name: str) -> FileResponse:
    path = STATIC_DIR / name
    if path.suffix not in MEDIA_TYPES or path.parent != STATIC_DIR or not path.is_file():
        raise NotFound(f"no dashboard asset named '{name}'")
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers={"Cache-Control": "no-cache"})


# ---- totals ------------------------------------------------------------------------------------


def totals(families: Sequence[Metric]) -> dict[str, Any]:
    """Counters since start-up, summed over the labels the page does not split by (on the Ray
    ingress, over the replicas too)."""
    lookups = _by_label(families, "toolkv_cache_lookups_total", "result")
    hits, misses = lookups.get("hit", 0.0), lookups.get("miss", 0.0)
    prompt = _value(families, "toolkv_prompt_tokens_total")
    cached = _value(families, "toolkv_prompt_tokens_cached_total")
    return {
        **request_totals(families, "toolkv_requests_total"),
        "lookups": lookups,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else None,
        "generated_tokens": _value(families, "toolkv_generation_tokens_total"),
        "cache_entries": _by_label(families, "toolkv_cache_entries", "tier"),
        "cache_bytes": _by_label(families, "toolkv_cache_bytes", "tier"),
    }


def request_totals(families: Sequence[Metric], sample_name: str) -> dict[str, float]:
    """Requests answered and how many of them were not 2xx, from a `status`-labelled counter."""
    requests = _by_label(families, sample_name, "status")
    return {"requests": sum(requests.values()),
            "errors": sum(n for status, n in requests.items() if not status.startswith("2"))}


def _by_label(families: Iterable[Metric], sample_name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            if sample.name == sample_name:
                key = sample.labels.get(label, "")
                out[key] = out.get(key, 0.0) + sample.value
    return out


def _value(families: Iterable[Metric], sample_name: str) -> float:
    return sum(_by_label(families, sample_name, "").values())


# ---- engine ------------------------------------------------------------------------------------


def engine(families: Sequence[Metric], view: EngineView) -> dict[str, Any]:
    """The engine as its series last saw it: sequences, steps, KV blocks, prefix cache in tokens;
    `view` says what the series cannot (the pool's size, the last step)."""
    blocks = _by_label(families, "toolkv_kv_blocks", "state")
    queries = _value(families, "vllm:prefix_cache_queries_total")
    hits = _value(families, "vllm:prefix_cache_hits_total")
    last = view.last_step
    return {
        "running": _value(families, "vllm:num_requests_running"),
        "waiting": _value(families, "vllm:num_requests_waiting"),
        "steps": _value(families, "toolkv_engine_steps_total"),
        "batch_size": {"last": last.batch_size if last else None,
                       "mean": _mean(families, "toolkv_batch_size")},
        "tokens_per_step": {"last": last.num_tokens if last else None,
                            "mean": _mean(families, "vllm:iteration_tokens_total")},
        "kv_blocks": {"total": view.kv_blocks_total, "used": blocks.get("used", 0.0),
                      "free": blocks.get("free", 0.0), "cached": blocks.get("cached", 0.0),
                      "block_tokens": view.kv_block_tokens},
        "kv_usage": _value(families, "vllm:kv_cache_usage_perc"),
        "preemptions": _value(families, "vllm:num_preemptions_total"),
        "prefix_cache": {"queries_tokens": queries, "hits_tokens": hits,
                         "hit_rate": hits / queries if queries else None},
    }


def _mean(families: Sequence[Metric], histogram_name: str) -> float | None:
    """A histogram's mean since start-up, None before its first observation."""
    count = _value(families, histogram_name + "_count")
    return _value(families, histogram_name + "_sum") / count if count else None


# ---- tool groups -------------------------------------------------------------------------------


def ram_groups(listing: Sequence[EntryInfo]) -> list[dict[str, Any]]:
    """Rows for the tool-group table, most recently used first. Only the RAM tier is listed
    (`listing`: the engine's stats snapshot's)."""
    return [{"group_id": e.group_id, "tool_names": list(e.tool_names), "num_tokens": e.num_tokens,
             "num_bytes": e.num_bytes, "hits": e.hits, "last_used_at": e.last_used_at, "tier": "ram",
             "pinned": e.pinned} for e in listing[:MAX_GROUP_ROWS]]


async def pins(state: GatewayState, runtime: Runtime | None, listing: Sequence[EntryInfo]) -> dict[str, Any] | None:
    """The pinned groups (`tier`: ram, or disk when not in RAM now), the bytes pinned and the
    budget, as `GET /v1/cache` counts them. A pinned group not in RAM is looked up on disk once,
    then remembered (an entry's group never changes): a poll does not read the disk each time."""
    if runtime is None:
        return None
    store = runtime.store
    pinned = store.pins.pinned()
    in_ram = {e.digest: e for e in listing if e.digest in pinned}
    seen = state.dashboard_pinned
    for digest in seen.keys() - pinned.keys():
        del seen[digest]
    if unknown := pinned.keys() - in_ram.keys() - seen.keys():
        listed = {i.digest: i for i in await asyncio.to_thread(runtime.admin.entries) if i.digest in unknown}
        seen.update({digest: listed.get(digest) for digest in unknown})
    rows = [_pinned_row(digest, num_bytes, in_ram.get(digest) or seen.get(digest), digest in in_ram)
            for digest, num_bytes in pinned.items()]
    return {"pinned_bytes": sum(pinned.values()), "pinned_budget_bytes": state.settings.pinned_budget_bytes,
            "groups": sorted(rows, key=lambda row: row["num_bytes"], reverse=True)[:MAX_GROUP_ROWS]}


def _pinned_row(digest: str, num_bytes: int, info: EntryInfo | None, in_ram: bool) -> dict[str, Any]:
    """A pinned group; one whose entry is gone from every tier (removed meanwhile) has only its id."""
    return {"id": digest, "group_id": info.group_id if info else None,
            "tool_names": list(info.tool_names) if info else [], "num_tokens": info.num_tokens if info else None,
            "num_bytes": num_bytes, "tier": "ram" if in_ram else ("disk" if info else None)}


# ---- TTFT over time ----------------------------------------------------------------------------


@dataclass(slots=True)
class HistogramState:
    """Cumulative bucket counts (last one is +Inf) and the sum of one labelled histogram series,
    and the slowest observation since start when the gateway reports it (TTFT_MAX): no request
    of a window took longer, and the window that set it holds exactly it."""

    counts: list[float]
    sum_s: float = 0.0
    max_s: float | None = None

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def minus(self, before: HistogramState | None) -> HistogramState:
        if before is None:
            return self
        counts = [a - b for a, b in zip(self.counts, before.counts, strict=True)]
        return HistogramState(counts, self.sum_s - before.sum_s, self.max_s)

    def plus(self, other: HistogramState) -> HistogramState:
        if not self.counts:
            return other
        counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        maxima = [m for m in (self.max_s, other.max_s) if m is not None]
        return HistogramState(counts, self.sum_s + other.sum_s, max(maxima) if maxima else None)


@dataclass(slots=True)
class Window:
    start_s: float
    series: dict[str, HistogramState] = field(default_factory=dict)

    def to_json(self, bounds: list[float]) -> dict[str, Any]:
        body: dict[str, Any] = {"t": self.start_s}
        for label, state in self.series.items():
            mean_s = state.sum_s / state.count
            # one request is its own p50 and p95; bucket interpolation would only blur it, and could
            # put a quantile above the slowest request (544 s in a 160-640 s bucket whose one request took 338)
            slowest_s = min(max_bound(bounds, state.counts, state.sum_s), state.max_s or math.inf)
            p50_s, p95_s = ((mean_s, mean_s) if state.count == 1 else
                            (min(quantile(0.5, bounds, state.counts), slowest_s),
                             min(quantile(0.95, bounds, state.counts), slowest_s)))
            body[label] = {"count": int(state.count), "mean_ms": 1000 * mean_s,
                           "p50_ms": 1000 * p50_s, "p95_ms": 1000 * p95_s}
        return body


class TtftWindows:
    """TTFT p50/p95 per fixed time window, for hits and misses, from the change in the Prometheus
    histogram between two looks (the serving layer records into the histogram only). Requests that
    finish while no one looks are counted in the window of the next look. Each series (one per
    `cache` label, and per `replica` on the Ray ingress) is followed on its own: a replica that
    restarted (its counts went down) or did not answer one look adds nothing twice."""

    def __init__(self, window_s: float = 10.0, max_windows: int = 180) -> None:
        self.window_s = window_s
        self.bounds: list[float] = []
        self._last: dict[SeriesKey, HistogramState] = {}
        self._windows: deque[Window] = deque(maxlen=max_windows)

    def sample(self, source: Collectable, now_s: float) -> None:
        """Look at the TTFT histogram in `source` (the histogram itself, or any collector holding it)."""
        bounds, current = read_histogram(source.collect())
        self.bounds = bounds or self.bounds
        for key, state in current.items():
            delta = state.minus(self._last.get(key))
            if key.cache in TTFT_LABELS and delta.count > 0 and min(delta.counts) >= 0:
                window = self._window_at(now_s)
                window.series[key.cache] = window.series.get(key.cache, HistogramState([])).plus(delta)
        self._last.update(current)

    def to_json(self) -> list[dict[str, Any]]:
        return [window.to_json(self.bounds) for window in self._windows]

    def _window_at(self, now_s: float) -> Window:
        start_s = math.floor(now_s / self.window_s) * self.window_s
        if not self._windows or self._windows[-1].start_s != start_s:
            self._windows.append(Window(start_s))
        return self._windows[-1]


CHART_SERIES = (("hit", "p50_ms"), ("hit", "p95_ms"), ("miss", "p50_ms"), ("miss", "p95_ms"))
OUTLIER_FACTOR = 5.0


def ttft_ceiling_ms(windows: Sequence[dict[str, Any]]) -> float | None:
    """The TTFT chart's y-axis top: the highest point that is not an outlier (None: no point). A
    point is an outlier when it is more than OUTLIER_FACTOR times the median of its series' other
    points (hit or miss, p50 or p95): one slow window (the first request after start, a machine
    that paused) would otherwise squash every other point against the axis. The page draws a point
    above the ceiling at the top, marked with its value."""
    ceiling: float | None = None
    for label, key in CHART_SERIES:
        values = sorted(float(w[label][key]) for w in windows if label in w and w[label].get(key) is not None)
        for i, value in enumerate(values):
            others = values[:i] + values[i + 1 :]  # still sorted
            if others and value > OUTLIER_FACTOR * _median(others):
                continue
            ceiling = value if ceiling is None else max(ceiling, value)
    return ceiling


def _median(ordered: list[float]) -> float:
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def new_ttft_windows() -> TtftWindows:
    """An app's windows (one per app, never module-level: gateway/api/state.py)."""
    return TtftWindows()


@dataclass(frozen=True, slots=True)
class SeriesKey:
    replica: str  # "" on a single gateway
    cache: str


def read_histogram(families: Iterable[Metric], name: str = TTFT_HISTOGRAM,
                   max_name: str = TTFT_MAX) -> tuple[list[float], dict[SeriesKey, HistogramState]]:
    """(finite bucket bounds, series -> state) of the `cache`-labelled histogram `name` among `families`,
    with each series' slowest since start from the gauge `max_name` where there is one."""
    bounds: set[float] = set()
    series: dict[SeriesKey, HistogramState] = {}
    for family in families:
        for sample in family.samples:  # buckets come in ascending order within a series
            if sample.name not in (name + "_bucket", name + "_sum", max_name):
                continue
            key = SeriesKey(sample.labels.get("replica", ""), sample.labels.get("cache", ""))
            state = series.setdefault(key, HistogramState([]))
            if sample.name.endswith("_bucket"):
                state.counts.append(sample.value)
                bounds.update([float(sample.labels["le"])] if sample.labels["le"] != "+Inf" else [])
            elif sample.name == max_name:
                state.max_s = sample.value
            else:
                state.sum_s = sample.value
    return sorted(bounds), {key: state for key, state in series.items() if state.counts}


def max_bound(bounds: list[float], cumulative: list[float], sum_s: float) -> float:
    """The most the slowest observation can be, from the histogram alone: no more than its bucket's
    upper bound, and no more than the sum less the least every other observation can be (the
    lower bound of its bucket). Exact for one observation; for two, off by at most the other's
    distance from its bucket's lower bound. Not Prometheus': histogram_quantile ignores the sum."""
    counts = [b - a for a, b in zip([0.0, *cumulative[:-1]], cumulative, strict=True)]
    lowers = [0.0, *bounds]  # bucket i holds (lowers[i], uppers[i]]; the last is +Inf's
    uppers = [*bounds, math.inf]
    top = max((i for i, n in enumerate(counts) if n > 0), default=None)
    if top is None:
        return math.inf
    others_least = sum(n * lower for n, lower in zip(counts, lowers, strict=True)) - lowers[top]
    return min(uppers[top], sum_s - others_least)


def quantile(q: float, bounds: list[float], cumulative: list[float]) -> float:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding rank q."""
    total = cumulative[-1]
    rank = q * total
    for index, upper in enumerate(bounds):
        if cumulative[index] >= rank:
            lower = bounds[index - 1] if index else 0.0
            below = cumulative[index - 1] if index else 0.0
            inside = cumulative[index] - below
            return lower + (upper - lower) * ((rank - below) / inside if inside else 1.0)
    return bounds[-1] if bounds else math.nan  # rank in the +Inf bucket: the highest finite bound
