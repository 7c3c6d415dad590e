"""What the model wrote, as the typed answer every API renders (gateway/protocol/answer.py): the
content and tool calls of a whole answer, the events of a streamed one, and the finish reason a
turn with calls gets; what the answer is measured by (`Accounting`: TTFT, latency, tokens,
cache result), into the Prometheus metrics and the request log line; and its logprobs on the wire.

What the answer starts from and gathers: `Prepared`, a request ready for the engine (its job) and
what its answer needs, and `Outcome`, what the answer gathers as the engine's events arrive (and
the `usage` it reports).

Logprobs: each token's bytes and text, and the engine's per-token entries
(`sampling.TokenLogprob`) in OpenAI's chat shape (`choices[i].logprobs.content`), spread over a
stream's chunks, and in the legacy completions shape (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`).

A chosen token's `bytes` are exactly what it adds to the answer's text, so the entries' bytes
joined decode to `content`: a special token the answer's text leaves out (`<|im_start|>` from a
random model) has `""` and no bytes, among its entry's alternatives too (so the legacy shape's
`top_logprobs`, keyed by text, holds it once). A token that is part of a character (byte-level
BPE splits `世` in three) has its raw bytes, and its `token` writes them as `\\xNN`, as OpenAI's
does.
"""

from __future__ import annotations

import codecs
import logging
import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from adapters.base import ChatFamily
from adapters.toolcalls import ContentDelta, ToolCallArgsDelta, ToolCallStart
from adapters.toolcalls.incremental import SyntaxStreamer
from gateway.engine import EngineEvent, Finished, Job, Prefilled, TextDelta, Tokenizer, TokenLogprob
from gateway.engine.events import JobStream
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


LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for a log probability too small to write (-inf)
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


class TokenTexts:
    """Each token's UTF-8 bytes as the tokenizer's decoder writes them into text (read once per
    token, on first use) and the logprob entries built from them."""

    def __init__(self, tokenizer: Tokenizer, special_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._special = frozenset(special_ids)
        self._byte_decoder = _byte_decoder() if _is_byte_level(tokenizer) else None
        self._added = {i: t.content for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        found = self._bytes.get(token_id)
        if found is None:
            found = self._bytes[token_id] = self._read(token_id)
        return found

    def _read(self, token_id: int) -> bytes:
        added: str | None = self._added.get(token_id)
        if added is not None:  # added tokens are written as they are, never byte-mapped
            return added.encode()
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):  # an id past the vocabulary (the model's padding)
            return b""
        if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
            return bytes(self._byte_decoder[c] for c in piece)
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece writes a space as `▁`

    def content(self, entries: Iterable[TokenLogprob], keep_ids: frozenset[int]) -> list[dict[str, Any]]:
        """`entries` as `logprobs.content` items; `keep_ids`: special tokens the answer's text keeps."""
        hidden = self._special - keep_ids
        return [{**_item(self._written(e.token_id, hidden), e.logprob),
                 # the chosen token reads the same among the alternatives (its own entry's text);
                 # the others as the tokenizer writes them, hidden special tokens included
                 "top_logprobs": [_item(self._written(i, hidden) if i == e.token_id else self.bytes_of(i), lp)
                                  for i, lp in e.top]} for e in entries]

    def _written(self, token_id: int, hidden: frozenset[int]) -> bytes:
        """What the chosen `token_id` adds to the answer's text."""
        return b"" if token_id in hidden else self.bytes_of(token_id)


class StreamLogprobs:
    """A stream's logprobs not yet sent. Each chunk takes the entries of the tokens sampled since
    the previous chunk that took any: text a parser holds back (a possible tool call's opening)
    goes out later, and its tokens' logprobs with it. None (`null`) when there are none or the
    request did not ask."""

    def __init__(self, texts: TokenTexts | None, keep_ids: frozenset[int]) -> None:
        self._texts = texts
        self._keep_ids = keep_ids
        self._pending: list[TokenLogprob] = []

    def add(self, entries: Iterable[TokenLogprob]) -> None:
        if self._texts is not None:
            self._pending.extend(entries)

    def take(self) -> list[dict[str, Any]] | None:
        if self._texts is None or not self._pending:
            return None
        content = self._texts.content(self._pending, self._keep_ids)
        self._pending.clear()
        return content


class LegacyLogprobs:
    """Chat logprobs in the legacy completions shape, over one answer (whole or chunk by chunk):
    `text_offset` counts the characters of the answer before each token."""

    def __init__(self, asked: bool) -> None:
        self._asked = asked
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        self._chars = 0

    def shape(self, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        """Chat-shaped entries (None: no tokens) in this shape; None when not asked for."""
        if not self._asked:
            return None
        content = entries or []
        offsets = []
        for entry in content:
            offsets.append(self._chars)
            self._chars += len(self._decoder.decode(bytes(entry["bytes"])))
        return {"tokens": [e["token"] for e in content],
                "token_logprobs": [e["logprob"] for e in content],
                # the top alternatives and, as OpenAI's, always the chosen token (up to logprobs + 1)
                "top_logprobs": [{**{t["token"]: t["logprob"] for t in e["top_logprobs"]}, e["token"]: e["logprob"]}
                                 for e in content],
                "text_offset": offsets}


def _item(raw: bytes, logprob: float) -> dict[str, Any]:
    return {"token": raw.decode("utf-8", errors="backslashreplace"),
            "logprob": logprob if math.isfinite(logprob) else LOGPROB_FLOOR, "bytes": list(raw)}


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    """True for a byte-level BPE tokenizer (GPT-2's, Llama 3's, Qwen's, SmolLM's): its pieces are
    bytes mapped to printable characters."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder is not None and b'"ByteLevel"' in decoder.__getstate__()  # its JSON, nested or not


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-character map, reversed: printable bytes stand for themselves, the rest
    for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}
