"""The engine: sequences, KV block pool, scheduler, model runner and the step loop."""

from gateway.engine.core import (
    CacheResult,
    Engine,
    EngineEvent,
    Failed,
    Finished,
    Job,
    Prefilled,
    QueueFull,
    TextDelta,
)
from gateway.engine.stats import EngineStats, StepRecord

__all__ = ["CacheResult", "Engine", "EngineEvent", "EngineStats", "Failed", "Finished", "Job", "Prefilled",
           "QueueFull", "StepRecord", "TextDelta"]
