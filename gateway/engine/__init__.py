"""The engine: sequences, KV block pool, scheduler, model runner and the step loop."""

from gateway.engine.core import Engine
from gateway.engine.events import (
    CacheResult,
    EngineEvent,
    Failed,
    Finished,
    Job,
    Prefilled,
    QueueFull,
    TextDelta,
    TooLarge,
)
from gateway.engine.stats import EngineStats, StepRecord

__all__ = ["CacheResult", "Engine", "EngineEvent", "EngineStats", "Failed", "Finished", "Job", "Prefilled",
           "QueueFull", "StepRecord", "TextDelta", "TooLarge"]
