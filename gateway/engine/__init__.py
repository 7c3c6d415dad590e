"""The engine: the one owner of the model and of the batch. A `Job` comes in (`Engine.submit`: a
prompt's token ids, its `SamplingParams` and its grammar's `Constraint`), is scheduled by
continuous batching on one worker thread, runs through the model a step at a time (the model
runner, paged attention, sampling under the grammar's mask) and comes out as events, in order.

Its KV lives in a block pool and a prefix store it holds but does not define (gateway/kvcache:
blocks, tiers, keys); where a prompt's chunks end and which cached prefix a prompt reuses are
decided here (chunks, prefix_index, cache_manager). It also loads the model and its tokenizer
(model_loader, gguf_copy, models/). It never imports serving or the HTTP layers: the grammars'
text and their compiled cache, the prompt and the answer are serving's.
"""

from gateway.engine.constraints import Constraint, matcher_error
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
from gateway.engine.sampling import SamplingParams, TokenLogprob
from gateway.engine.stats import EngineStats, StepRecord
from gateway.engine.tokenizer import Tokenizer

__all__ = ["CacheResult", "Constraint", "Engine", "EngineEvent", "EngineStats", "Failed", "Finished", "Job",
           "Prefilled", "QueueFull", "SamplingParams", "StepRecord", "TextDelta", "TokenLogprob", "Tokenizer",
           "TooLarge", "matcher_error"]
