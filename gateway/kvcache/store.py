"""The prefix store: one lookup/insert facade over the tiers (RAM now; disk behind it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from gateway.kvcache.entry import CacheEntry
from gateway.kvcache.keys import PrefixKey
from gateway.kvcache.ram_tier import Eviction, RamTier

log = logging.getLogger(__name__)

Tier = Literal["ram", "disk"]


@dataclass(frozen=True, slots=True)
class Found:
    entry: CacheEntry
    tier: Tier


class PrefixStore:
    def __init__(self, ram: RamTier) -> None:
        self.ram = ram
        self.evictions: list[Eviction] = []  # drained by the metrics collector

    def lookup(self, key: PrefixKey) -> Found | None:
        entry = self.ram.match(key)
        if entry is not None:
            return Found(entry, "ram")
        return None

    def insert(self, entry: CacheEntry) -> None:
        self.evictions.extend(self.ram.insert(entry))

    def lock(self, entry: CacheEntry) -> None:
        self.ram.lock(entry.key.digest)

    def unlock(self, entry: CacheEntry) -> None:
        self.ram.unlock(entry.key.digest)
