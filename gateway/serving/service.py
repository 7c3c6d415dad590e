"""Serving: turn a validated chat request into an engine job, and engine events into OpenAI
responses (whole or streamed). Owns tokenization and the cut at the end of the tool group."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from adapters.base import ChatFamily, ChatMessage, RenderedPrompt, ToolSpec
from adapters.render import PromptRenderer, RenderError
from adapters.toolcalls import ContentDelta, ToolCallArgsDelta, ToolCallStart
from adapters.toolcalls.incremental import SyntaxStreamer
from gateway.engine import Engine, EngineEvent, Failed, Finished, Job, Prefilled, QueueFull, TextDelta, TooLarge
from gateway.engine.constraints import Constraint, GrammarError, Grammars, Mode, json_grammar, tool_grammar
from gateway.engine.sampling import SamplingParams, TokenLogprob
from gateway.errors import BadRequest, ContextLengthExceeded, GenerationFailed, Overloaded
from gateway.metrics import Metrics
from gateway.protocol import chat as protocol
from gateway.protocol.chat import AllowedToolsChoice, ChatCompletionRequest, NamedToolChoice
from gateway.serving.finite_schemas import has_finite_instance
from gateway.serving.logprobs import StreamLogprobs, TokenTexts
from gateway.serving.prompt_tokens import PromptTokenizer

log = logging.getLogger(__name__)


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
    prefilled: Prefilled | None = None  # set when the engine reports the prefill
    request_id: str = field(default_factory=protocol.new_completion_id)  # also the completion's id
    legacy_functions: bool = False  # asked with `functions`: answer with `function_call`

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
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)


class ChatService:
    def __init__(self, engine: Engine, tokenizer: Any, family: ChatFamily, model_name: str,
                 context_len: int, metrics: Metrics, *, cache_enabled: bool, default_max_tokens: int,
                 max_string_chars: int = 0, reserve_tokens: int = 0) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.family = family
        self.renderer = PromptRenderer(tokenizer, family)
        self.prompt_tokens = PromptTokenizer(tokenizer)
        self.marker_ids = _marker_ids(tokenizer, family.call_markers)
        self.max_token_chars = max_token_chars(tokenizer)
        self.model_name = model_name
        # OpenAI's "backend configuration" fingerprint: the model, tokenizer, template, adapter and
        # chunking (the cache identity); it changes exactly when the same request could answer
        # differently.
        identity = engine.identity.digest_bytes() if engine is not None else model_name.encode()  # None: render only
        self.system_fingerprint = "fp_" + hashlib.sha256(identity).hexdigest()[:12]
        self.context_len = context_len
        self.metrics = metrics
        self.cache_enabled = cache_enabled
        self.default_max_tokens = default_max_tokens
        self.grammars = Grammars(tokenizer, _vocab_size(engine, tokenizer), engine.eos_ids if engine else ())
        self.call_specials = _special_markers(tokenizer, family.call_markers, engine)
        self.max_string_chars = max_string_chars  # the bound on strings a schema leaves unbounded
        self.reserve_tokens = reserve_tokens  # a constrained output's last tokens steer to its end
        # special tokens "auto" free text may hold, as without a grammar (not the end of the output)
        self.free_specials = tuple(sorted(engine.special_ids - engine.eos_ids)) if engine is not None else ()
        self.token_texts = TokenTexts(tokenizer, engine.special_ids if engine is not None else ())
        self.num_token_ids = _num_token_ids(engine, tokenizer)

    # ---- preparing -------------------------------------------------------------------------

    def prepare(self, req: ChatCompletionRequest, bypass: bool = False, received: float | None = None, *,
                salt_for: Callable[[str], str] | None = None, tenant: str = "",
                request_id: str | None = None) -> Prepared:
        """The engine job for `req`; `received` is when the request arrived (perf_counter).

        `salt_for(group_id)` gives the tenant's cache salt for the group (default: the shared
        namespace, ""). It also
        namespaces the tokenizer's remembered heads, so tenants never share prepare-time state.
        `tenant` (the tenant's own salt) namespaces its conversation KV, shared groups or not.
        Blocking (render + tokenize): call it off the event loop."""
        received = time.perf_counter() if received is None else received
        messages = [m.to_chat() for m in req.messages]
        self._check_characters(messages)
        tools = [t.to_spec() for t in req.tools or ()]
        check_unique_names(tools)
        _check_tool_choice(req)
        rendered = self._render(messages, tools)
        group_id = rendered.group.group_id  # a hash of the whole group: computed once
        salt = salt_for(group_id) if salt_for is not None else ""
        forced = self._forced_call(req, tools)
        ids, prefix_len, commit = self.prompt_tokens.encode_pending(rendered.text, rendered.prefix_chars, salt)
        forced_ids: list[int] = []
        if forced.opening:  # the suffix only; the opening is generated text, never part of the prefix
            forced_ids = self.tokenizer(forced.opening, add_special_tokens=False)["input_ids"]
            ids += forced_ids
        params = self._sampling(req, len(ids))
        single_call = req.parallel_tool_calls is False
        if forced.complete and single_call:  # the answer is wholly forced: nothing may follow it
            params = dataclasses.replace(params, max_tokens=0)
        use_cache = self.cache_enabled and not bypass
        tools_active = bool(tools) and req.tool_choice != "none"
        if params.max_tokens:  # a grammar will hold the output to these schemas
            check_finite_schemas(tools if tools_active else [], req.response_format)
        # a wholly forced call that more may follow is under the grammar too: it consumes the call
        constraint = None if params.max_tokens == 0 else self._constraint(req, rendered.group.tools, tools_active,
                                                                          forced_ids, params.max_tokens)
        job = Job(prompt_ids=ids, prefix_len=prefix_len, params=params, emit=_unset_emit,
                  use_cache=use_cache, salt=salt, tenant=tenant, group_id=group_id,
                  tool_names=rendered.group.tool_names,
                  keep_token_ids=self.marker_ids if tools_active else frozenset(), constraint=constraint)
        commit()  # accepted: only now may its tokenized head be remembered
        return Prepared(job=job, model_name=self.model_name,
                        tools_active=tools_active,
                        forced_opening=forced.opening, single_call=single_call,
                        use_cache=use_cache, group_id=group_id, started=received,
                        prepare_s=time.perf_counter() - received,
                        request_id=request_id or protocol.new_completion_id(),
                        legacy_functions=req.legacy_functions)

    def _check_characters(self, messages: list[ChatMessage]) -> None:
        """Reject a prompt that cannot fit before rendering or tokenizing it: no token spans more
        than `max_token_chars` characters, so text longer than context x that is over the context
        whatever it tokenizes to. Message texts appear verbatim in the rendered prompt."""
        chars = sum(len(m.content or "") for m in messages)
        if chars > self.context_len * self.max_token_chars:
            raise ContextLengthExceeded(
                f"the messages hold {chars} characters, more than this model's context of "
                f"{self.context_len} tokens can take", param="messages")

    def _render(self, messages: list[ChatMessage], tools: list[ToolSpec]) -> RenderedPrompt:
        try:
            return self.renderer.render(messages, tools)
        except RenderError as exc:
            raise BadRequest(str(exc), param="messages") from None

    def _forced_call(self, req: ChatCompletionRequest, tools: list[ToolSpec]) -> ForcedCall:
        """`required` forces the opening of some call; a named function (or `required` with one
        tool) forces the opening with its name, or the whole call when it takes no arguments."""
        name = _forced_name(req, tools)
        if name is None:
            required = req.tool_mode == "required" and bool(tools)
            return ForcedCall(self.family.call_opening(None) if required else "")
        if next(t for t in tools if t.name == name).takes_no_arguments:
            return ForcedCall(self.family.call_text(name), complete=True)
        return ForcedCall(self.family.call_opening(name))

    def _constraint(self, req: ChatCompletionRequest, tools: tuple[ToolSpec, ...], tools_active: bool,
                    forced_ids: list[int], max_tokens: int) -> Constraint | None:
        """The grammar this request's output must follow (gateway/engine/constraints.py), having
        consumed the forced opening; None when the output is free text."""
        answer = req.response_format.answer_schema if req.response_format is not None else None
        mode: Mode = "auto"
        if tools_active:
            only = _forced_name(req, list(tools))
            mode = "required" if req.tool_mode == "required" else "auto"
            callable_tools = [t for t in tools if req.may_call(t.name)]  # all still in the prompt
            grammar = tool_grammar(self.family.call_syntax(), callable_tools, mode=mode, only=only,
                                   parallel=req.parallel_tool_calls is not False,
                                   answer_schema=answer, specials=self.call_specials,
                                   max_string=self.max_string_chars, free_tokens=self.free_specials)
            param = "tools"
        elif answer is not None:
            grammar, param = json_grammar(answer, self.max_string_chars), "response_format"
        else:
            return None
        try:
            # the reserve is at most a quarter of the budget, so a short answer is not all closing
            # ... and never in "auto" free text: steering would end the model's own answer early
            free_text = tools_active and mode == "auto" and answer is None
            closing = (max_tokens - min(self.reserve_tokens, max_tokens // 4)
                       if self.reserve_tokens and not free_text else None)
            return self.grammars.constraint(grammar, param, forced_ids, closing)
        except GrammarError as exc:
            raise BadRequest(str(exc), param=self._bad_schema(tools, exc.param)) from None

    def _bad_schema(self, tools: tuple[ToolSpec, ...], param: str) -> str:
        """The first tool whose schema alone does not compile (`tools[i].function.parameters`)."""
        if param != "tools":
            return param
        for index, tool in enumerate(tools):
            try:
                self.grammars.constraint(json_grammar(tool.parameters or {"type": "object"}), "tools")
            except GrammarError:
                return f"tools[{index}].function.parameters"
        return param

    def tokenize(self, text: str, prefix_chars: int) -> tuple[list[int], int]:
        """A rendered prompt's tokens (as one text; see gateway.serving.prompt_tokens) and how many are the
        tool group, in the shared namespace (what warming fills)."""
        return self.prompt_tokens.encode(text, prefix_chars)

    def _sampling(self, req: ChatCompletionRequest, prompt_len: int) -> SamplingParams:
        room = self.context_len - prompt_len
        if room < 1:
            raise ContextLengthExceeded(
                f"the prompt is {prompt_len} tokens; this model's context is {self.context_len} tokens",
                param="messages")
        asked = req.max_completion_tokens or req.max_tokens
        if asked is not None and asked > room:
            raise ContextLengthExceeded(
                f"prompt ({prompt_len} tokens) + max_tokens ({asked}) exceeds the context of "
                f"{self.context_len} tokens", param="max_tokens")
        temperature = 1.0 if req.temperature is None else req.temperature
        return SamplingParams(max_tokens=min(asked or self.default_max_tokens, room),
                              temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p,
                              seed=req.seed, stop=req.stop_sequences, logprobs=bool(req.logprobs),
                              top_logprobs=req.top_logprobs or 0, frequency_penalty=req.frequency_penalty or 0.0,
                              presence_penalty=req.presence_penalty or 0.0,
                              logit_bias=self.logit_bias(req.logit_bias))

    def logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """`logit_bias` (keys already checked to be decimal ids) as (token id, bias) pairs; a 400
        naming it for an id this model does not have."""
        pairs = tuple((int(key), value) for key, value in (bias or {}).items())
        for token, _ in pairs:
            if token >= self.num_token_ids:
                raise BadRequest(f"logit_bias names token {token}, which is not in this model's vocabulary "
                                 f"(token ids 0..{self.num_token_ids - 1})", param="logit_bias")
        return pairs

    def logprobs_content(self, prepared: Prepared, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        """`choices[0].logprobs` of a whole answer: None unless the request asked for logprobs."""
        if not prepared.job.params.logprobs:
            return None
        return {"content": self.token_texts.content(entries, prepared.job.keep_token_ids), "refusal": None}

    # ---- running ---------------------------------------------------------------------------

    async def events(self, prepared: Prepared) -> AsyncIterator[EngineEvent]:
        """Run the job on the engine; cancelling this iterator cancels the generation."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[EngineEvent] = asyncio.Queue()

        def emit(event: EngineEvent) -> None:  # called on the engine thread
            loop.call_soon_threadsafe(inbox.put_nowait, event)

        prepared.job.emit = emit
        try:
            self.engine.submit(prepared.job)
        except QueueFull:
            raise Overloaded("the server is busy: too many requests are queued; retry shortly",
                             headers={"Retry-After": "1"}) from None
        except TooLarge as exc:  # no Retry-After: it will not fit later either
            raise Overloaded(f"{exc}; send a shorter prompt or a lower max_tokens, or raise "
                             "ram_budget_bytes") from None
        try:
            while True:
                event = await inbox.get()
                if isinstance(event, Prefilled):
                    prepared.prefilled = event
                yield event
                if isinstance(event, (Finished, Failed)):
                    return
        finally:
            self.engine.abort(prepared.job)  # no-op when finished; stops and frees it otherwise

    async def complete(self, prepared: Prepared) -> dict[str, Any]:
        outcome = Outcome()
        async for event in self.events(prepared):
            self._observe(prepared, outcome, event)
            if isinstance(event, TextDelta):
                outcome.text_parts.append(event.text)
                outcome.logprobs.extend(event.logprobs)
            elif isinstance(event, Failed):
                raise GenerationFailed(event.message)
        assert outcome.finish is not None and outcome.prefilled is not None
        message, finish_reason = self._message("".join(outcome.text_parts), prepared, outcome.finish)
        usage = _usage(prepared, outcome)
        self._record(prepared, outcome, "200", stream=False)
        return protocol.completion_dict(prepared.request_id, prepared.model_name, message,
                                        finish_reason, usage, self.system_fingerprint,
                                        logprobs=self.logprobs_content(prepared, outcome.logprobs),
                                        legacy_functions=prepared.legacy_functions)

    def _message(self, text: str, prepared: Prepared, finish: Finished) -> tuple[dict[str, Any], str]:
        """The assistant message and finish reason. A tool turn is read by the same streamer the
        streamed response uses (its output follows the family's call syntax: the grammar saw to
        that), so both carry the same content and calls. A call cut off by `max_tokens` comes
        back as OpenAI returns it: the call with the arguments written so far, finish `length`."""
        if not prepared.tools_active:
            return {"role": "assistant", "content": text, "refusal": None}, finish.finish_reason
        streamer = SyntaxStreamer(self.family.call_syntax())
        pieces = streamer.feed(prepared.forced_opening + text) + streamer.finish()
        if streamer.parse_failed:
            self.metrics.tool_parse_failures.inc()
        content = "".join(p.text for p in pieces if isinstance(p, ContentDelta)) or None
        calls: dict[int, dict[str, Any]] = {}
        for piece in pieces:
            if isinstance(piece, ToolCallStart) and not (prepared.single_call and piece.index > 0):
                calls[piece.index] = {"id": protocol.new_tool_call_id(), "type": "function",
                                      "function": {"name": piece.name, "arguments": ""}}
            elif isinstance(piece, ToolCallArgsDelta) and piece.index in calls:
                calls[piece.index]["function"]["arguments"] += piece.fragment
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if not calls:
            return message, finish.finish_reason
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
        return message, _call_finish(finish)

    async def stream(self, prepared: Prepared, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        """Chunks: role first, then content / tool-call deltas, one finish_reason, optional usage.
        A client that goes away cancels the generation, and is counted and logged as 499."""
        outcome = Outcome()
        try:
            async for chunk in self._stream(prepared, include_usage, outcome):
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            self.record_disconnect(prepared, outcome, stream=True)
            raise

    def record_disconnect(self, prepared: Prepared, outcome: Outcome | None = None, *, stream: bool) -> None:
        """The client went away before the response was complete (nginx's 499)."""
        self._record(prepared, outcome or Outcome(prefilled=prepared.prefilled), "499", stream=stream)

    async def _stream(self, prepared: Prepared, include_usage: bool,
                      outcome: Outcome) -> AsyncIterator[dict[str, Any]]:
        chunk = functools.partial(protocol.chunk_dict, prepared.request_id, int(time.time()), prepared.model_name,
                                  system_fingerprint=self.system_fingerprint,
                                  legacy_functions=prepared.legacy_functions)
        logprobs = StreamLogprobs(self.token_texts if prepared.job.params.logprobs else None,
                                  prepared.job.keep_token_ids)
        streamer = SyntaxStreamer(self.family.call_syntax()) if prepared.tools_active else None
        calls = _CallTracker(single=prepared.single_call)
        opening = streamer.feed(prepared.forced_opening) if streamer and prepared.forced_opening else []
        handoff = prepared.job.first_token_sent = threading.Event()
        events = self.events(prepared)
        first = await anext(events)  # raises Overloaded before any byte is sent
        # A forced call's answer is only calls: its content is null from the first chunk, as OpenAI's
        yield chunk({"role": "assistant", "content": None if prepared.forced_opening else ""})
        for delta in calls.deltas(opening):
            yield chunk(delta)
        async for event in _chain(first, events):
            self._observe(prepared, outcome, event)
            if isinstance(event, Failed):
                self._record(prepared, outcome, "500", stream=True)
                raise GenerationFailed(event.message)
            if isinstance(event, TextDelta):
                logprobs.add(event.logprobs)
                pieces = streamer.feed(event.text) if streamer else [ContentDelta(event.text)]
                for delta in calls.deltas(pieces):
                    yield chunk(delta, logprobs=logprobs.take())
                handoff.set()  # the consumer asked for more: the chunks above were sent
        if streamer is not None:
            for delta in calls.deltas(streamer.finish()):
                yield chunk(delta, logprobs=logprobs.take())
            if streamer.parse_failed:
                self.metrics.tool_parse_failures.inc()
        assert outcome.finish is not None
        reason = _call_finish(outcome.finish) if calls.count else outcome.finish.finish_reason
        yield chunk({}, finish_reason=reason, logprobs=logprobs.take())  # what no text chunk carried
        if include_usage:
            yield chunk(None, usage=_usage(prepared, outcome))
        self._record(prepared, outcome, "200", stream=True)

    # ---- accounting ------------------------------------------------------------------------

    def _observe(self, prepared: Prepared, outcome: Outcome, event: EngineEvent) -> None:
        if isinstance(event, Prefilled):
            outcome.prefilled = event
        elif isinstance(event, TextDelta) and outcome.ttft_s is None:
            outcome.ttft_s = time.perf_counter() - prepared.started
        elif isinstance(event, Finished):
            outcome.finish = event
            if outcome.ttft_s is None:
                outcome.ttft_s = time.perf_counter() - prepared.started

    def _record(self, prepared: Prepared, outcome: Outcome, status: str, stream: bool) -> None:
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
        completion = outcome.finish.completion_tokens if outcome.finish else 0
        m.generated_tokens.inc(completion)
        if outcome.ttft_s is not None:
            m.ttft.labels(cache=pre.result).observe(outcome.ttft_s)
        total_s = time.perf_counter() - prepared.started
        m.latency.labels(cache=pre.result).observe(total_s)
        log.info("request done", extra={"toolkv": {
            "request_id": prepared.request_id, "group_id": prepared.group_id, "prompt_tokens": pre.prompt_tokens,
            "cached_tokens": pre.cached_tokens, "completion_tokens": completion,
            "cache": pre.result, "ttft_ms": round((outcome.ttft_s or 0) * 1000, 1),
            "latency_ms": round(total_s * 1000, 1), "status": status}})


class _CallTracker:
    """Turns parser deltas into OpenAI delta dicts; gives each call an id once."""

    def __init__(self, single: bool) -> None:
        self.single = single
        self.count = 0

    def deltas(self, pieces: list[Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, ContentDelta):
                if piece.text:
                    out.append({"content": piece.text})
            elif self.single and getattr(piece, "index", 0) > 0:
                continue
            elif isinstance(piece, ToolCallStart):
                self.count += 1
                out.append({"tool_calls": [{"index": piece.index, "id": protocol.new_tool_call_id(),
                                            "type": "function",
                                            "function": {"name": piece.name, "arguments": ""}}]})
            elif isinstance(piece, ToolCallArgsDelta):
                out.append({"tool_calls": [{"index": piece.index,
                                            "function": {"arguments": piece.fragment}}]})
        return out


async def _chain(first: EngineEvent, rest: AsyncIterator[EngineEvent]) -> AsyncIterator[EngineEvent]:
    yield first
    async for event in rest:
        yield event


def _usage(prepared: Prepared, outcome: Outcome) -> dict[str, Any]:
    pre = outcome.prefilled
    completion = outcome.finish.completion_tokens if outcome.finish else 0
    return protocol.usage_dict(pre.prompt_tokens if pre else 0, completion, pre.cached_tokens if pre else 0,
                               prepared.cache_write_tokens)


def check_unique_names(tools: list[Any]) -> None:
    """400 naming the first tool whose function name repeats an earlier one."""
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        if tool.name in seen:
            raise BadRequest(f"tools[{index}].function.name '{tool.name}' appears twice",
                             param=f"tools[{index}].function.name")
        seen.add(tool.name)


def check_finite_schemas(tools: list[ToolSpec], response_format: protocol.ResponseFormat | None) -> None:
    """400 naming the first schema no finite value is valid for (gateway/serving/finite_schemas.py): its
    grammar would compile, then fail in the middle of the answer."""
    named = [(f"tools[{index}].function.parameters", tool.parameters) for index, tool in enumerate(tools)]
    answer = response_format.answer_schema if response_format is not None else None
    for param, schema in [*named, ("response_format.json_schema.schema", answer)]:
        if schema is not None and not has_finite_instance(schema):
            raise BadRequest(f"{param} has no finite value: every value it allows holds another one (a $ref "
                             "that loops back with no way out); make the recursion optional (not required, "
                             "minItems 0, or anyOf with null)", param=param)


def _check_tool_choice(req: ChatCompletionRequest) -> None:
    choice, listed = req.tool_choice, {t.function.name for t in req.tools or ()}
    if choice == "required" and not listed:
        raise BadRequest("tool_choice 'required' needs 'tools'", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in listed:
        raise BadRequest(f"tool_choice names the function '{choice.function.name}', which is not in 'tools'",
                         param="tool_choice")
    for index, allowed in enumerate(choice.allowed_tools.tools if isinstance(choice, AllowedToolsChoice) else ()):
        if allowed.function.name not in listed:
            param = f"tool_choice.allowed_tools.tools[{index}].function.name"
            raise BadRequest(f"{param} names the function '{allowed.function.name}', which is not in 'tools' "
                             "(allowed tools are a subset of 'tools')", param=param)


def _forced_name(req: ChatCompletionRequest, tools: list[ToolSpec]) -> str | None:
    """The one tool a call must name: a named function, or `required` with one callable tool."""
    names = [t.name for t in tools if req.may_call(t.name)]
    return names[0] if req.tool_mode == "required" and len(names) == 1 else None


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for. A vocabulary entry's string has one character
    per byte (byte-level BPE) or per character (SentencePiece's `▁` for a space), and a character
    is at least one byte, so no token covers more characters than its entry is long. (This holds
    for tokenizers whose normalizer never deletes characters: every chat model's here.)"""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def _marker_ids(tokenizer: Any, markers: tuple[str, ...]) -> frozenset[int]:
    """Ids of the family's call markers that are single tokens in this vocabulary."""
    vocab = tokenizer.get_vocab()
    return frozenset(vocab[m] for m in markers if m in vocab)


def _call_finish(finish: Finished) -> str:
    """A turn with calls ends `tool_calls`, unless `max_tokens` cut it (OpenAI's `length`)."""
    return "length" if finish.finish_reason == "length" and finish.completion_tokens > 0 else "tool_calls"


def _vocab_size(engine: Engine | None, tokenizer: Any) -> int:
    """How many logits the model gives per position (at least the tokenizer's vocabulary)."""
    config = getattr(getattr(engine, "model", None), "config", None)
    return max(int(getattr(config, "vocab_size", 0) or 0), len(tokenizer))


def _special_markers(tokenizer: Any, markers: tuple[str, ...], engine: Engine | None) -> dict[str, int]:
    """The family's call markers that are special tokens here: a grammar names them by id."""
    vocab = tokenizer.get_vocab()
    special = engine.special_ids if engine is not None else frozenset()
    return {m: vocab[m] for m in markers if m in vocab and vocab[m] in special}


def _num_token_ids(engine: Engine | None, tokenizer: Any) -> int:
    """Token ids the tokenizer knows and the model scores (its logits may be padded past them)."""
    config = getattr(getattr(engine, "model", None), "config", None)
    scored = int(getattr(config, "vocab_size", 0) or 0)
    return min(len(tokenizer), scored) if scored else len(tokenizer)


def _unset_emit(event: EngineEvent) -> None:
    raise RuntimeError("job submitted without an event sink")

