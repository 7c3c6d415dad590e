"""What the model wrote, as the typed answer every API renders (gateway/protocol/answer.py): the
content and tool calls of a whole answer, the events of a streamed one, and the finish reason a
turn with calls gets; and what the answer is measured by (`Accounting`: TTFT, latency, tokens,
cache result), into the Prometheus metrics and the request log line."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from adapters.base import ChatFamily
from adapters.toolcalls import ContentDelta, ToolCallArgsDelta, ToolCallStart
from adapters.toolcalls.incremental import SyntaxStreamer
from gateway.engine import EngineEvent, Finished, Prefilled, TextDelta
from gateway.metrics import Metrics
from gateway.protocol import chat_output
from gateway.protocol.answer import (
    AnswerEvent,
    CallArguments,
    CallStarted,
    Ended,
    FinishReason,
    Logprobs,
    Started,
    TextWritten,
    ToolCall,
    Usage,
)
from gateway.serving.jobs import Outcome, Prepared
from gateway.serving.logprobs import StreamLogprobs, TokenTexts


def content_and_calls(family: ChatFamily, text: str, prepared: Prepared, finish: Finished,
                      on_parse_failure: Callable[[], None]) -> tuple[str | None, tuple[ToolCall, ...], FinishReason]:
    """The answer's content, calls and finish reason. A tool turn is read by the same streamer the
    streamed response uses (its output follows the family's call syntax: the grammar saw to
    that), so both carry the same content and calls. A call cut off by `max_tokens` comes
    back as OpenAI returns it: the call with the arguments written so far, finish `length`."""
    if not prepared.tools_active:
        return text, (), finish.finish_reason
    streamer = SyntaxStreamer(family.call_syntax())
    pieces = streamer.feed(prepared.forced_opening + text) + streamer.finish()
    if streamer.parse_failed:
        on_parse_failure()
    content = "".join(p.text for p in pieces if isinstance(p, ContentDelta)) or None
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for piece in pieces:
        if isinstance(piece, ToolCallStart) and not (prepared.single_call and piece.index > 0):
            names[piece.index], arguments[piece.index] = piece.name, []
        elif isinstance(piece, ToolCallArgsDelta) and piece.index in names:
            arguments[piece.index].append(piece.fragment)
    calls = tuple(ToolCall(chat_output.new_tool_call_id(), names[i], "".join(arguments[i])) for i in sorted(names))
    return content, calls, call_finish(finish) if calls else finish.finish_reason


class CallTracker:
    """Turns parser pieces into answer events; gives each call an id once. `take_logprobs` gives
    each event the entries not sent yet (None: none, or not asked)."""

    def __init__(self, single: bool) -> None:
        self.single = single
        self.count = 0

    def events(self, pieces: list[Any], take_logprobs: Callable[[], Logprobs] = lambda: None) -> list[AnswerEvent]:
        out: list[AnswerEvent] = []
        for piece in pieces:
            if isinstance(piece, ContentDelta):
                if piece.text:
                    out.append(TextWritten(piece.text, take_logprobs()))
            elif self.single and getattr(piece, "index", 0) > 0:
                continue
            elif isinstance(piece, ToolCallStart):
                self.count += 1
                out.append(CallStarted(piece.index, chat_output.new_tool_call_id(), piece.name, take_logprobs()))
            elif isinstance(piece, ToolCallArgsDelta):
                out.append(CallArguments(piece.index, piece.fragment, take_logprobs()))
        return out


class StreamedAnswer:
    """One streamed answer: the engine's events in, the answer's events out (`start` once the
    prompt is in, `write` per text delta, `end` with the finish). Plain calls, no generator: the
    service's one generator drives it."""

    def __init__(self, family: ChatFamily, prepared: Prepared, token_texts: TokenTexts,
                 on_parse_failure: Callable[[], None]) -> None:
        self.prepared = prepared
        self.logprobs = StreamLogprobs(token_texts if prepared.job.params.logprobs else None,
                                       prepared.job.keep_token_ids)
        self.streamer = SyntaxStreamer(family.call_syntax()) if prepared.tools_active else None
        self.calls = CallTracker(single=prepared.single_call)
        self.on_parse_failure = on_parse_failure

    def start(self, prompt: Usage) -> list[AnswerEvent]:
        """`Started`, then the forced call's opening (written by us, not the model)."""
        opening = self.prepared.forced_opening
        pieces = self.streamer.feed(opening) if self.streamer is not None and opening else []
        return [Started(prompt, bool(opening)), *self.calls.events(pieces)]

    def write(self, delta: TextDelta) -> list[AnswerEvent]:
        self.logprobs.add(delta.logprobs)
        pieces = self.streamer.feed(delta.text) if self.streamer is not None else [ContentDelta(delta.text)]
        return self.calls.events(pieces, self.logprobs.take)

    def end(self, finish: Finished, usage: Usage) -> list[AnswerEvent]:
        """The calls' last pieces, then `Ended` with the entries no event carried."""
        events: list[AnswerEvent] = []
        if self.streamer is not None:
            events = self.calls.events(self.streamer.finish(), self.logprobs.take)
            if self.streamer.parse_failed:
                self.on_parse_failure()
        reason = call_finish(finish) if self.calls.count else finish.finish_reason
        events.append(Ended(reason, usage, self.logprobs.take(), finish.stop_sequence))
        return events


def call_finish(finish: Finished) -> FinishReason:
    """A turn with calls ends `tool_calls`, unless `max_tokens` cut it (OpenAI's `length`)."""
    return "length" if finish.finish_reason == "length" and finish.completion_tokens > 0 else "tool_calls"


# ---- accounting ----------------------------------------------------------------------------


log = logging.getLogger("gateway.serving.service")  # the request log's logger, as operators filter it


class Accounting:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def observe(self, prepared: Prepared, outcome: Outcome, event: EngineEvent) -> None:
        if isinstance(event, Prefilled):
            outcome.prefilled = event
        elif isinstance(event, TextDelta):
            outcome.generated = event.tokens
            if outcome.ttft_s is None:
                outcome.ttft_s = time.perf_counter() - prepared.started
        elif isinstance(event, Finished):
            outcome.finish = event
            if outcome.ttft_s is None:
                outcome.ttft_s = time.perf_counter() - prepared.started

    def record(self, prepared: Prepared, outcome: Outcome, status: str, stream: bool) -> None:
        m, pre = self.metrics, outcome.prefilled
        m.requests.labels(status=status, stream=str(stream).lower()).inc()
        if pre is None:
            log.info("request done", extra={"toolkv": {
                "request_id": prepared.request_id, "group_id": prepared.group_id, "status": status,
                "latency_ms": round((time.perf_counter() - prepared.started) * 1000, 1)}})
            return
        m.cache_lookups.labels(result=pre.result, tier=pre.tier or "none").inc()
        m.prompt_tokens.inc(pre.prompt_tokens)
        m.cached_tokens.inc(pre.cached_tokens)
        m.computed_tokens.inc(pre.prompt_tokens - pre.cached_tokens)
        if pre.result == "miss":
            m.compile_seconds.observe(pre.compile_s)
        if pre.result == "hit":
            m.restore_seconds.observe(pre.restore_s)
        completion = outcome.completion_tokens  # a client that left: the tokens generated for it
        m.generated_tokens.inc(completion)
        if outcome.ttft_s is not None:
            m.observe_ttft(pre.result, outcome.ttft_s)
        total_s = time.perf_counter() - prepared.started
        m.latency.labels(cache=pre.result).observe(total_s)
        log.info("request done", extra={"toolkv": {
            "request_id": prepared.request_id, "group_id": prepared.group_id, "prompt_tokens": pre.prompt_tokens,
            "cached_tokens": pre.cached_tokens, "completion_tokens": completion,
            "cache": pre.result, "ttft_ms": round((outcome.ttft_s or 0) * 1000, 1),
            "latency_ms": round(total_s * 1000, 1), "status": status}})
