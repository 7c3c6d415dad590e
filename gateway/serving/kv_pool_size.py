"""How big the KV block pool is, when `ram_budget_bytes` does not say: sized to the model and the
machine once the weights are loaded.

- CUDA: `gpu_memory_utilization` (vLLM's flag; default 0.9) of the device memory still free once
  the weights are on it. vLLM's share counts the weights too; toolkv's is of what they leave, so
  the same number leaves the model's activations and the CUDA graphs the rest.
- CPU: room for `CPU_FULL_SEQUENCES` sequences of the model's whole context (`max_model_len` caps
  it), and never more than `gpu_memory_utilization` (default 0.25 on the CPU) of the RAM available
  now (MemAvailable, within a cgroup memory limit). SmolLM2-135M in float32: 46,080 bytes a token,
  8,192 tokens of context, so 1.41 GiB (2 GiB before, whatever the model).

The pool holds running requests and cached tool groups alike; on the CPU its pages become resident
as blocks are first written, so a fresh server's RSS grows into it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from gateway.settings import Settings, format_size

CPU_FULL_SEQUENCES = 4
DEFAULT_SHARE = {"cuda": 0.9, "cpu": 0.25}
_CGROUP_MEMORY = ((Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
                  (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                   Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")))


@dataclass(frozen=True, slots=True)
class PoolSize:
    num_bytes: int
    reason: str  # how it was decided, for the log and the error of a pool too small

    @property
    def described(self) -> str:
        size = format_size(self.num_bytes)
        if self.reason == "ram_budget_bytes":
            return f"ram_budget_bytes ({size})"
        return f"the KV pool ({size}: {self.reason})"


def kv_pool_size(settings: Settings, device: torch.device, bytes_per_token: int, context_len: int) -> PoolSize:
    """The pool's bytes: `ram_budget_bytes` when set, else as the module says."""
    if settings.ram_budget_bytes is not None:
        return PoolSize(settings.ram_budget_bytes, "ram_budget_bytes")
    share = pool_share(settings, device)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        return PoolSize(_whole_mib(share * free), f"{share:g} of the {_gib(free)} free on {device} after the weights")
    available = available_ram_bytes()
    full = CPU_FULL_SEQUENCES * context_len * bytes_per_token
    if full <= share * available:
        return PoolSize(_whole_mib(full), f"{CPU_FULL_SEQUENCES} sequences of {context_len:,} tokens, within {share:g} "
                                          f"of the {_gib(available)} of RAM available")
    return PoolSize(_whole_mib(share * available), f"{share:g} of the {_gib(available)} of RAM available")


def _whole_mib(num_bytes: float) -> int:
    """Whole MiB, or the bytes themselves under one MiB (a tiny model's short context: rounding
    that down left a pool of no block)."""
    return int(num_bytes) // 1024**2 * 1024**2 or int(num_bytes)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 1024**3:.1f} GiB"


def pool_share(settings: Settings, device: torch.device) -> float:
    return settings.gpu_memory_utilization or DEFAULT_SHARE["cuda" if device.type == "cuda" else "cpu"]


def available_ram_bytes() -> int:
    """MemAvailable, and no more than a cgroup memory limit leaves."""
    available = _meminfo_available()
    for limit_path, usage_path in _CGROUP_MEMORY:
        try:
            limit, usage = limit_path.read_text().strip(), int(usage_path.read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max", or v1's page-rounded "no limit"
            available = min(available, max(0, int(limit) - usage))
        break
    return available


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:  # not Linux: physical memory as the bound
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return 8 * 1024**3


def describe_default(settings: Settings, device: torch.device) -> str:
    """What the pool will be, before the model is loaded (`toolkv config`)."""
    share = pool_share(settings, device)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        return f"auto: {share:g} of the GPU memory free after the weights ({_gib(free)} free now)"
    return (f"auto: {CPU_FULL_SEQUENCES} sequences of the model's context, at most {share:g} of the "
            f"{_gib(available_ram_bytes())} of RAM available (at most {_gib(int(share * available_ram_bytes()))})")
