"""What a server's engine holds in memory, from its /metrics (`toolkv_memory_bytes{part}`: the
weights, the KV pool, the CUDA graphs), and how the report writes it. A server that does not
export the series (a peer, an older toolkv) has None for every part."""

from __future__ import annotations

from typing import Any

from gateway.bench.client import BenchClient

PARTS = {"weights": "weights", "kv_pool": "KV pool", "cuda_graphs": "CUDA graphs"}


def memory_from_metrics(metrics: dict[str, float]) -> dict[str, int | None]:
    """{part}_bytes for each part, from a /metrics read (client.parse_metrics's form)."""
    return {f"{part}_bytes": _int(metrics.get(f'toolkv_memory_bytes{{part="{part}"}}')) for part in PARTS}


async def read_memory(client: BenchClient) -> dict[str, int | None]:
    return memory_from_metrics(await client.metrics())


def memory_text(memory: dict[str, Any] | None) -> str | None:
    """'weights 14.70 GB, KV pool 40.00 GB, CUDA graphs 350.0 MB'; None when the server said nothing."""
    if not memory or all(memory.get(f"{part}_bytes") is None for part in PARTS):
        return None
    return ", ".join(f"{label} {bytes_text(memory.get(f'{part}_bytes'))}" for part, label in PARTS.items())


def bytes_text(num_bytes: int | None) -> str:
    """'14.70 GB' from 1 GB up, '540.0 MB' below; '-' when not known."""
    if num_bytes is None:
        return "-"
    return f"{num_bytes / 1e9:,.2f} GB" if num_bytes >= 1e9 else f"{num_bytes / 1e6:,.1f} MB"


def memory_lines(memory: dict[str, Any] | None) -> list[str]:
    text = memory_text(memory)
    if text is None:
        return ["memory: the server exports no toolkv_memory_bytes (not a toolkv, or one from before it did)"]
    return [f"memory (the server's engine, on its device): {text}"]


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)
