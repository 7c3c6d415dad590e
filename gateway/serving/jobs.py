"""A prepared request: the engine job and what its answer needs, and what the answer gathers as
the engine's events arrive (`Outcome`, and the `usage` it reports)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.engine import Finished, Job, Prefilled, TokenLogprob
from gateway.engine.events import JobStream
from gateway.protocol import chat_output
from gateway.protocol.answer import Usage


@dataclass(slots=True)
class Prepared:
    """A request ready for the engine, and what its response needs."""

    job: Job
    model_name: str
    tools_active: bool  # parse tool calls from the output
    forced_opening: str  # text appended after the generation prompt to force a call
    single_call: bool
    use_cache: bool
    group_id: str
    started: float = field(default_factory=time.perf_counter)  # request arrival: TTFT counts from here
    prepare_s: float = 0.0  # arrival to job: parse, validate, render, tokenize
    events: JobStream | None = None  # what Engine.submit returned: the job's events
    request_id: str = field(default_factory=chat_output.new_completion_id)  # also the completion's id
    legacy_functions: bool = False  # asked with `functions`: answer with `function_call`

    @property
    def prefilled(self) -> Prefilled | None:
        """The engine's prefill report, once it made it."""
        return self.events.prefilled if self.events is not None else None

    def response_headers(self) -> dict[str, str]:
        """`X-Toolkv-Cache` (hit/miss/bypass/skip) and a W3C `Server-Timing` of where the time went
        before the first token, in ms: the engine's model forward is `prefill`; the rest is ours."""
        pre = self.prefilled
        if pre is None:
            return {}
        parts = [("prepare", self.prepare_s), ("queue", pre.queued_s), ("lookup", pre.lookup_s),
                 ("compile", pre.compile_s), ("restore", pre.restore_s), ("prefill", pre.forward_s)]
        timing = ", ".join(f"{name};dur={seconds * 1000:.2f}" for name, seconds in parts)
        return {"X-Toolkv-Cache": pre.result, "Server-Timing": timing}

    @property
    def cache_write_tokens(self) -> int:
        """Prompt tokens this request wrote to the cache: the tool group a miss computed and stored
        (all of it, as OpenAI counts writes, unadjusted). Conversation records are not counted: they
        live in the pool only, dropped first when it needs room."""
        pre = self.prefilled
        return self.job.prefix_len if pre is not None and pre.result == "miss" else 0


@dataclass(frozen=True, slots=True)
class ForcedCall:
    """`tool_choice` as text after the generation prompt, as if the model had written it."""

    opening: str = ""
    complete: bool = False  # the whole call: a named function that takes no arguments


@dataclass(slots=True)
class Outcome:
    prefilled: Prefilled | None = None
    ttft_s: float | None = None
    finish: Finished | None = None
    generated: int = 0  # tokens generated so far (the finish's count once finished)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def completion_tokens(self) -> int:
        return self.finish.completion_tokens if self.finish is not None else self.generated


def usage_of(prepared: Prepared, outcome: Outcome) -> Usage:
    """The answer's token counts so far (before the prefill: zeros)."""
    pre = outcome.prefilled
    completion = outcome.completion_tokens
    return Usage(pre.prompt_tokens if pre else 0, completion, pre.cached_tokens if pre else 0,
                 prepared.cache_write_tokens)
