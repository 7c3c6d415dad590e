"""The upstreams as the proxy sees them: requests in flight on each (what the router balances by)
and which are believed down. An upstream that failed is tried last for `down_s`, then first again
for its own groups; any answer from it marks it up. Touched only from the event loop."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from gateway.proxy.metrics import ProxyMetrics

Release = Callable[[], None]


class UpstreamPool:
    def __init__(self, urls: Sequence[str], down_s: float, metrics: ProxyMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.urls = tuple(urls)
        self.down_s = down_s
        self.metrics = metrics
        self._clock = clock
        self._in_flight = dict.fromkeys(self.urls, 0)
        self._down_until = dict.fromkeys(self.urls, 0.0)
        for url in self.urls:
            metrics.upstream_up.labels(upstream=url).set(1)
            metrics.upstream_in_flight.labels(upstream=url).set(0)

    def in_flight(self) -> dict[str, int]:
        return dict(self._in_flight)

    def down(self) -> frozenset[str]:
        now = self._clock()
        return frozenset(url for url, until in self._down_until.items() if until > now)

    def acquire(self, url: str) -> Release:
        """Count one request in flight on `url`; the returned callable ends it (once)."""
        self._in_flight[url] += 1
        self.metrics.upstream_in_flight.labels(upstream=url).inc()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._in_flight[url] -= 1
                self.metrics.upstream_in_flight.labels(upstream=url).dec()

        return release

    def mark_up(self, url: str) -> None:
        self._down_until[url] = 0.0
        self.metrics.upstream_up.labels(upstream=url).set(1)

    def mark_down(self, url: str) -> None:
        self._down_until[url] = self._clock() + self.down_s
        self.metrics.upstream_up.labels(upstream=url).set(0)
