"""What goes into the engine (a Job; a WarmGroup, a tool group to cache; or a Task to run on its
thread) and what comes out of a job (events, in order: Prefilled, TextDelta..., then Finished or
Failed)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from gateway.engine.sampling import SamplingParams, TokenLogprob
from gateway.kvcache.entry import CacheEntry
from gateway.kvcache.keys import PrefixKey

if TYPE_CHECKING:
    from gateway.engine.constraints import Constraint

CacheResult = Literal["hit", "miss", "bypass", "skip"]


@dataclass(frozen=True, slots=True)
class Prefilled:
    prompt_tokens: int
    cached_tokens: int
    result: CacheResult
    tier: str | None
    restore_s: float
    compile_s: float
    prefill_s: float  # from admission to the first token's logits: lookup, compile, prompt chunks
    forward_s: float = 0.0  # the model's own forward passes over the prompt after the group
    queued_s: float = 0.0  # from submit until the engine admitted the job
    lookup_s: float = 0.0  # key hash + cache lookup


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    # When the job asked for them, the logprobs of the tokens whose text ends in this delta (the
    # stream may hold text back: half a character, a possible stop sequence), see HeldLogprobs.
    logprobs: tuple[TokenLogprob, ...] = ()
    tokens: int = 0  # generated so far (a client that leaves before the end is counted with them)


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: Literal["stop", "length"]
    completion_tokens: int
    token_ids: tuple[int, ...] = ()
    stop_sequence: str | None = None  # the job's stop string that ended it, if one did


@dataclass(frozen=True, slots=True)
class Failed:
    message: str
    param: str | None = None  # set when the request is at fault (its schema ran the grammar past a limit): a 400
    shutting_down: bool = False  # cut off at the end of the shutdown grace period: a 503 the client may retry


EngineEvent = Prefilled | TextDelta | Finished | Failed


def _drop(event: EngineEvent) -> None:
    return None


@dataclass(slots=True)
class Job:
    prompt_ids: list[int]
    prefix_len: int  # tokens of the tool group; 0 when there is none
    params: SamplingParams
    # a sink of its own besides the stream Engine.submit returns (engine tests, the bench's floor);
    # called on the engine thread
    emit: Callable[[EngineEvent], None] = _drop
    use_cache: bool = True
    salt: str = ""  # the group's cache namespace ("" for a group listed in shared_groups)
    tenant: str = ""  # the tenant's own namespace: conversation KV is never shared between tenants
    group_id: str = ""
    tool_names: tuple[str, ...] = ()
    retention_s: float = 0.0  # keep the tool group cached at least this long (prompt_cache_retention); 0: LRU
    keep_token_ids: frozenset[int] = frozenset()  # special tokens the output text must keep
    constraint: Constraint | None = None  # the grammar its output follows (constraints.py)
    # Stop sequences apply only to the text before this, a tool call section's trigger: a call the
    # grammar holds to its schema is never cut into invalid arguments. "": the output starts inside
    # a call (a forced one), so they never apply; None: they apply to all of it.
    stop_before: str | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = 0.0  # perf_counter at submit


class WarmUpFailed(Exception):
    """Computing a warmed group failed (the server log has why)."""


@dataclass(slots=True)
class WarmGroup:
    """A tool group to cache, not a generation (`toolkv cache warm`, `warm_groups` at start,
    `POST /v1/cache/warm`): found in RAM or on disk, or computed into the store in chunks between
    other requests' steps. `future` gets the entry and whether it was cached already.

    The cache manager answers it on its own path (`KVCacheManager.place_group`); computing it is
    `job`'s: a prompt that is all group and asks for no tokens, so it ends once its group is stored
    (outputs.py). A failure reaches `future` through that job's events."""

    key: PrefixKey  # in the shared namespace
    group_id: str = ""
    tool_names: tuple[str, ...] = ()
    future: Future[tuple[CacheEntry, bool]] = field(default_factory=Future)
    job: Job = field(init=False)

    def __post_init__(self) -> None:
        self.job = Job(list(self.key.token_ids), len(self.key.token_ids), SamplingParams(max_tokens=0),
                       emit=self._report, group_id=self.group_id, tool_names=self.tool_names)

    def _report(self, event: EngineEvent) -> None:
        if isinstance(event, Failed) and not self.future.done():
            self.future.set_exception(WarmUpFailed(event.message))


class QueueFull(Exception):
    """Too many jobs are waiting; retry later."""


class TooLarge(Exception):
    """The job needs more KV blocks than the whole pool has: it can never run."""


class CutOff(Exception):
    """The shutdown grace period ran out while the job was still generating."""


@dataclass(slots=True)
class Task:
    """Work other than a generation that must run on the engine thread (e.g. listing)."""

    fn: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)
