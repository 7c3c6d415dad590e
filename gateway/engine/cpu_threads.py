"""torch's CPU threads: as many as the cores this process may use (its CPU affinity, and a cgroup
CPU quota when one is set: a container limited to 2 CPUs of a 64-core node gets 2, not 64), and
fewer while other work holds those cores.

Why fewer: every torch op on the CPU is an OpenMP parallel region that ends in a barrier, and a
forward of SmolLM2 runs about a thousand of them. When other processes hold the cores, each
barrier waits until the operating system schedules every thread of the team again, so an op costs
a scheduling delay, not its work. Measured on the 2-core development machine at load average
12-16 (2026-11-27): 77% of the engine thread's samples were in libgomp's barrier wait and 15% in
the matrix products; a 2,000-token group compile took minutes. One thread has no barrier to wait
at and gets its share of a core. So the engine measures, about once a second, how much of its
cores other processes used (/proc/stat over the cores it may use, minus its own CPU time), and
runs with the cores left over, at least one. With one thread, its own demand leaves the others'
share visible, so the count comes back up when they stop and does not flap while they run.

A thread count must never change a number: a hit and its bypass may run at different counts, and
cached output must equal uncached output. MKL splits most products' rows and columns among
threads, not their sums, so most shapes give the same bits on one and two threads; but on torch
2.13 on the development CPU a product of 5 to 7 or 9 to 11 rows takes another path by thread count,
and so does SDPA over a 1- or 3-token chunk. So, with an adaptive count (`adaptive_threads`, on by
default; only on toolkv's own model, engine/core.py): at start the engine probes each of the
model's product shapes at 1 to 16 rows on one thread and on all (`invariant_rows`), and a product
of a count that differs is padded to the next that does not (engine/models/layers.py); the torch
backend attends a chunk of up to 16 tokens with plain products read in place, not SDPA
(engine/attention.py). Matrix products of the attention and SDPA over longer chunks measured
alike on 1 and 2 threads for every shape tried (3/8/2/4/1 KV heads, head dims 64 to 256, 17-128
tokens over up to 3,000 keys; tests/engine/test_cpu_threads.py pins SmolLM2's). `num_threads`
(or `adaptive_threads: false`) fixes the count at start."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ADJUST_EVERY_S = 1.0
_SPARE_CORE_SHARE = 0.25  # others' stray use (a shell, a log writer) does not cost a thread
_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def usable_cpus() -> int:
    """The cores this process may run on: its affinity, capped by a cgroup CPU quota."""
    cpus = _affinity_count()
    quota = cgroup_cpu_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota is not None else cpus


def cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time the cgroup allows per period (cgroup v2 `cpu.max`, else v1), None when unlimited."""
    try:
        quota, period = _CGROUP_V2.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us, period_us = (int(p.read_text()) for p in _CGROUP_V1)
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def _affinity_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


@dataclass(slots=True)
class _Sample:
    at_s: float
    busy_s: float  # every usable core's busy time
    own_s: float  # this process's CPU time


class ThreadGovernor:
    """Sets torch's intra-op threads on the engine thread (OpenMP's thread count is the calling
    thread's own): `adjust()` before a step; at most one measurement a second."""

    def __init__(self, max_threads: int, every_s: float = ADJUST_EVERY_S) -> None:
        self.max_threads = max_threads
        self.every_s = every_s
        # Under a cgroup quota the cores are shared with the whole host: others' use of them says
        # nothing about this container's share, so the count stays at the quota's.
        self._cpus = _usable_cpu_ids() if cgroup_cpu_quota() is None else set()
        self._last = self._sample()
        self.threads = max_threads

    def adjust(self) -> int:
        now = time.monotonic()
        if now - self._last.at_s < self.every_s or self.max_threads == 1:
            return self.threads
        sample = self._sample()
        self._set(self.threads_for(self._others_cores(self._last, sample)))
        self._last = sample
        return self.threads

    def threads_for(self, others_cores: float) -> int:
        """The cores other processes leave, whole, between one and `max_threads`."""
        free = self.max_threads - others_cores
        return max(1, min(self.max_threads, math.floor(free + _SPARE_CORE_SHARE)))

    def _set(self, threads: int) -> None:
        if threads != self.threads:
            log.info("CPU threads %d -> %d (other processes use %s of the %d usable cores)", self.threads, threads,
                     "more" if threads < self.threads else "less", self.max_threads)
            torch.set_num_threads(threads)
            self.threads = threads

    @staticmethod
    def _others_cores(before: _Sample, after: _Sample) -> float:
        wall_s = max(after.at_s - before.at_s, 1e-6)
        return max(0.0, (after.busy_s - before.busy_s) - (after.own_s - before.own_s)) / wall_s

    def _sample(self) -> _Sample:
        return _Sample(time.monotonic(), _busy_s(self._cpus), time.process_time())


def _usable_cpu_ids() -> set[str]:
    try:
        return {f"cpu{i}" for i in os.sched_getaffinity(0)}
    except (AttributeError, OSError):
        return set()


def _busy_s(cpus: set[str]) -> float:
    """Busy seconds of the given cores since boot (/proc/stat: user, nice, system, irq, softirq,
    steal); 0 where /proc/stat cannot be read (no adjustment then: nothing seems used)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0
    try:
        with open("/proc/stat") as fh:
            for line in fh:
                name, _, rest = line.partition(" ")
                if name in cpus:
                    fields = [int(v) for v in rest.split()]
                    total += fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + fields[7]
    except (OSError, ValueError, IndexError):
        return 0.0
    return total / ticks


PROBED_ROWS = 16  # MKL's small-row products; from 12 rows up every count measured rounds alike


def invariant_rows(weights: Iterable[torch.Tensor], threads: int, up_to: int = PROBED_ROWS) -> tuple[int, ...]:
    """The row counts in `1..up_to` whose product with every one of `weights` (one of each shape
    and dtype is tried) gives the same bits on one thread as on `threads`. A product of another
    count is padded up to the next of these (engine/models/layers.py), so a thread count that
    adapts never changes a number. Measured at start, on random rows: MKL picks a product's path
    by its shape and the thread count, never by the values. Float weights only (a quantized
    product is not probed)."""
    probes: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}
    for weight in weights:
        if weight.dim() == 2 and weight.is_floating_point():
            probes.setdefault((tuple(weight.shape), weight.dtype), weight)
    every = tuple(range(1, up_to + 1))
    if threads <= 1 or not probes:
        return every
    before = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            rows = tuple(m for m in every if all(_rounds_alike(m, w, threads, gen) for w in probes.values()))
    finally:
        torch.set_num_threads(before)
    if rows != every:
        log.info("products of %s rows round differently on 1 and %d threads: padded to the next of %s",
                 sorted(set(every) - set(rows)), threads, list(rows))
    return rows


def _rounds_alike(rows: int, weight: torch.Tensor, threads: int, gen: torch.Generator) -> bool:
    x = torch.randn(rows, weight.shape[1], generator=gen).to(weight.dtype)
    torch.set_num_threads(1)
    one = torch.nn.functional.linear(x, weight)
    torch.set_num_threads(threads)
    return torch.equal(one, torch.nn.functional.linear(x, weight))
