"""`toolkv bench`: TTFT, latency and cache hit measurements through the real HTTP API."""

from __future__ import annotations

from typing import Any


def register(sub: Any) -> None:
    """Add the `bench` subcommand to the CLI's subparsers."""
    del sub
