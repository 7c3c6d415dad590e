"""The chat service: a validated chat request becomes an engine job (render, tokenize and cut at the
end of the tool group, the grammar, sampling), and the engine's events become the typed answer
every API renders (gateway/protocol/answer.py), whole or streamed (assembled by answers.py,
measured by accounting.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson

from adapters.base import ChatFamily, ChatMessage, RenderedPrompt, ToolSpec
from adapters.render import PromptRenderer, RenderError
from gateway.engine import (
    Engine,
    Failed,
    Job,
    QueueFull,
    SamplingParams,
    TextDelta,
    Tokenizer,
    TokenLogprob,
    TooLarge,
)
from gateway.engine.events import JobStream
from gateway.engine.model_info import ModelInfo
from gateway.errors import (
    APIError,
    BadRequest,
    ContextLengthExceeded,
    GenerationFailed,
    Overloaded,
    ShuttingDown,
)
from gateway.metrics import Metrics
from gateway.protocol import chat_output
from gateway.protocol.answer import Answer, AnswerEvent
from gateway.protocol.chat import ChatCompletionRequest
from gateway.protocol.generation import GenerationRequest, Sampling
from gateway.serving.answers import (
    Accounting,
    Outcome,
    Prepared,
    StreamedAnswer,
    TokenTexts,
    content_and_calls,
    usage_of,
)
from gateway.serving.grammars import GRAMMAR_CACHE_BYTES, Grammars
from gateway.serving.literal_specials import LiteralSpecials, cut, written_by
from gateway.serving.output_grammar import (
    OutputGrammar,
    check_finite_schemas,
    check_tool_choice,
    check_unique_names,
    marker_ids,
)
from gateway.serving.prompt_tokens import MAX_HEAD_BYTES, PromptTokenizer

log = logging.getLogger(__name__)


def _nothing() -> None:
    return None


class ChatService:
    def __init__(self, engine: Engine, info: ModelInfo, tokenizer: Tokenizer, family: ChatFamily, model_name: str,
                 context_len: int, metrics: Metrics, *, cache_enabled: bool, default_max_tokens: int,
                 max_string_chars: int = 0, reserve_tokens: int = 0, grammar_cache_bytes: int = GRAMMAR_CACHE_BYTES,
                 tokenizer_heads_bytes: int = MAX_HEAD_BYTES) -> None:
        self.engine = engine
        self.info = info
        self.tokenizer = tokenizer
        self.family = family
        self.renderer = PromptRenderer(tokenizer, family)
        self.prompt_tokens = PromptTokenizer(tokenizer, max_bytes=tokenizer_heads_bytes)
        self.literal_specials = LiteralSpecials(tokenizer, written_by(self.renderer))
        self.marker_ids = marker_ids(tokenizer, family.call_markers)
        self.max_token_chars = max_token_chars(tokenizer)
        self.model_name = model_name
        # OpenAI's "backend configuration" fingerprint: the model, tokenizer, template, adapter and
        # chunking (the cache identity); it changes exactly when the same request could answer
        # differently.
        identity = info.fingerprint_bytes or model_name.encode()  # no identity: a service that only renders
        self.system_fingerprint = "fp_" + hashlib.sha256(identity).hexdigest()[:12]
        self.context_len = context_len
        self.metrics = metrics
        self.accounting = Accounting(metrics)
        self.cache_enabled = cache_enabled
        self.default_max_tokens = default_max_tokens
        self.output = OutputGrammar(tokenizer, info, family, max_string_chars=max_string_chars,
                                    reserve_tokens=reserve_tokens, grammar_cache_bytes=grammar_cache_bytes)
        self.token_texts = TokenTexts(tokenizer, info.special_ids)
        self.num_token_ids = info.num_token_ids

    @property
    def grammars(self) -> Grammars:
        """The compiled grammars, kept per tenant (their memory is a metric)."""
        return self.output.grammars

    # ---- preparing -------------------------------------------------------------------------

    def prepare(self, req: GenerationRequest | ChatCompletionRequest, bypass: bool = False,
                received: float | None = None, *, salt_for: Callable[[str], str] | None = None, tenant: str = "",
                request_id: str | None = None) -> Prepared:
        """The engine job for `req` (a chat request is taken as its GenerationRequest); its errors
        name the fields as `req.fields` says. `received` is when the request arrived (perf_counter).

        `salt_for(group_id)` gives the tenant's cache salt for the group (default: the shared
        namespace, ""). It also
        namespaces the tokenizer's remembered heads, so tenants never share prepare-time state.
        `tenant` (the tenant's own salt) namespaces its conversation KV, shared groups or not.
        Blocking (render + tokenize): call it off the event loop."""
        received = time.perf_counter() if received is None else received
        req = req.to_generation() if isinstance(req, ChatCompletionRequest) else req
        messages, tools, names = list(req.messages), list(req.tools), req.fields
        self._check_characters(messages, tools, names.messages)
        check_unique_names(tools, names)
        check_tool_choice(req)
        rendered = self._render(messages, tools, names.messages)
        self._check_characters_rendered(rendered.text, names.messages)
        group_id = rendered.group.group_id  # a hash of the whole group: computed once
        salt = salt_for(group_id) if salt_for is not None else ""
        forced = self.output.forced_call(req, tools)
        ids, prefix_len, commit = self.encode_prompt(messages, tools, rendered, salt, names.messages)
        forced_ids: list[int] = []
        if forced.opening:  # the suffix only; the opening is generated text, never part of the prefix
            forced_ids = self.tokenizer(forced.opening, add_special_tokens=False)["input_ids"]
            ids += forced_ids
        params = self.sampling(req.sampling, len(ids), max_tokens=req.max_tokens, max_tokens_param=names.max_tokens,
                               default_max_tokens=self.default_max_tokens, prompt_param=names.messages)
        single_call = not req.parallel_tool_calls
        if forced.complete and single_call:  # the answer is wholly forced: nothing may follow it
            params = dataclasses.replace(params, max_tokens=0)
        use_cache = self.cache_enabled and not bypass
        tools_active = bool(tools) and req.tool_choice.mode != "none"
        if params.max_tokens:  # a grammar will hold the output to these schemas
            check_finite_schemas(req, tools if tools_active else [], self.output.finite(tenant))
        # a wholly forced call that more may follow is under the grammar too: it consumes the call
        constraint = None if params.max_tokens == 0 else self.output.constraint(
            req, rendered.group.tools, tools_active, forced_ids, params.max_tokens, tenant)
        job = Job(prompt_ids=ids, prefix_len=prefix_len, params=params, use_cache=use_cache, salt=salt,
                  tenant=tenant, group_id=group_id,
                  tool_names=rendered.group.tool_names, retention_s=req.retention_s,
                  keep_token_ids=self.marker_ids if tools_active else frozenset(), constraint=constraint,
                  stop_before=self.output.stop_before(forced.opening) if tools_active else None)
        commit()  # accepted: only now may its tokenized head be remembered
        return Prepared(job=job, model_name=self.model_name,
                        tools_active=tools_active,
                        forced_opening=forced.opening, single_call=single_call,
                        use_cache=use_cache, group_id=group_id, started=received,
                        prepare_s=time.perf_counter() - received,
                        request_id=request_id or chat_output.new_completion_id(),
                        legacy_functions=req.legacy_functions)

    def prepare_ids(self, ids: list[int], params: SamplingParams, *, bypass: bool = False,
                    received: float | None = None, tenant: str = "", request_id: str | None = None) -> Prepared:
        """The engine job for a raw prompt (legacy completions): no template, no tool group; its
        KV still serves the tenant's later prompts that start with it."""
        received = time.perf_counter() if received is None else received
        use_cache = self.cache_enabled and not bypass
        job = Job(prompt_ids=ids, prefix_len=0, params=params, use_cache=use_cache, tenant=tenant)
        return Prepared(job=job, model_name=self.model_name, tools_active=False, forced_opening="",
                        single_call=False, use_cache=use_cache, group_id="", started=received,
                        prepare_s=time.perf_counter() - received,
                        request_id=request_id or chat_output.new_completion_id())

    def _check_characters(self, messages: list[ChatMessage], tools: list[ToolSpec], param: str) -> None:
        """Reject a prompt that cannot fit before rendering or tokenizing it: no token spans more
        than `max_token_chars` characters, so text longer than context x that is over the context
        whatever it tokenizes to. Counted, each at most what it takes in the rendered prompt: the
        message texts and tool-call names (verbatim), tool-call arguments (`_arguments_chars`), and
        each tool's name, description and parameters (as compact JSON: the least any template
        writes them in)."""
        chars = sum(len(m.content or "") + sum(len(c.name) + _arguments_chars(c.arguments) for c in m.tool_calls)
                    for m in messages)
        chars += sum(len(t.name) + len(t.description or "")
                     + (len(orjson.dumps(t.parameters).decode()) if t.parameters is not None else 0) for t in tools)
        if chars > self.context_len * self.max_token_chars:
            raise ContextLengthExceeded(
                f"the messages and tools hold {chars} characters, more than this model's context of "
                f"{self.context_len} tokens can take", param=param)

    def _check_characters_rendered(self, text: str, param: str) -> None:
        """The same bound on the rendered prompt, before tokenizing it (for whatever else a
        template writes: call ids, names...)."""
        if len(text) > self.context_len * self.max_token_chars:
            raise ContextLengthExceeded(
                f"the prompt holds {len(text)} characters, more than this model's context of "
                f"{self.context_len} tokens can take", param=param)

    def _render(self, messages: list[ChatMessage], tools: list[ToolSpec], param: str = "messages") -> RenderedPrompt:
        try:
            return self.renderer.render(messages, tools)
        except RenderError as exc:
            raise BadRequest(str(exc), param=param) from None

    def warm_up(self) -> None:
        """Pay before the server says it is ready what the first request would otherwise pay once:
        the template's first render and tokenize, and for constrained output llguidance's view of
        the vocabulary, the closing token sets and a first grammar's compile (about a second on
        the CPU: a first request with tools paid it on top of its own work). Nothing is kept."""
        started = time.perf_counter()
        tool = ToolSpec("warm_up", "", {"type": "object", "properties": {"x": {"type": "string"}},
                                        "required": ["x"]})
        rendered = self._render([ChatMessage("system", "warm-up"), ChatMessage("user", "hi")], [tool])
        self.tokenizer(rendered.text, add_special_tokens=False)
        self.output.warm_up(tool)
        log.info("service warm-up: %.1fs (template, tokenizer, grammar)", time.perf_counter() - started)

    def encode_prompt(self, messages: list[ChatMessage], tools: list[ToolSpec], rendered: RenderedPrompt,
                      namespace: str = "", param: str = "messages") -> tuple[list[int], int, Callable[[], None]]:
        """The rendered prompt's tokens, how many of them are the tool group, and the commit that
        remembers its tokenized head (gateway/serving/prompt_tokens.py). Client text holding a
        control token's text is tokenized as text (gateway/serving/literal_specials.py)."""
        if not self.literal_specials.found(messages, tools):
            ids, prefix_len, commit = self.prompt_tokens.encode_pending(rendered.text, rendered.prefix_chars, namespace)
            if not self.literal_specials.slipped(ids, rendered.text):
                return ids, prefix_len, commit
        try:
            masked = self._render(*self.literal_specials.masked(messages, tools), param)
            ids, ends = self.literal_specials.encode(rendered.text, masked.text)
        except BadRequest as exc:  # about the conversation's text: `param` is where the client wrote it
            raise BadRequest(exc.message, param=param) from None
        return ids, cut(ends, rendered.prefix_chars), _nothing

    def sampling(self, req: Sampling, prompt_len: int, *, max_tokens: int | None, default_max_tokens: int,
                 prompt_param: str, max_tokens_param: str = "max_tokens") -> SamplingParams:
        """A request's sampling; `max_tokens` is what it asked for (None: the default, cut to the
        room the context leaves), in the field `max_tokens_param`."""
        room = self.context_len - prompt_len
        if room < 1:
            raise ContextLengthExceeded(
                f"the prompt is {prompt_len} tokens; this model's context is {self.context_len} tokens",
                param=prompt_param)
        if max_tokens is not None and max_tokens > room:
            raise ContextLengthExceeded(
                f"prompt ({prompt_len} tokens) + '{max_tokens_param}' ({max_tokens}) exceeds the context of "
                f"{self.context_len} tokens", param=max_tokens_param)
        return SamplingParams(max_tokens=min(max_tokens or default_max_tokens, room),
                              temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, stop=req.stop,
                              logprobs=req.logprobs, top_logprobs=req.top_logprobs,
                              frequency_penalty=req.frequency_penalty or 0.0,
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

    def answer_logprobs(self, prepared: Prepared, entries: list[TokenLogprob]) -> list[dict[str, Any]] | None:
        """Every token's logprobs entry of a whole answer: None unless the request asked."""
        if not prepared.job.params.logprobs:
            return None
        return self.token_texts.content(entries, prepared.job.keep_token_ids)

    # ---- running ---------------------------------------------------------------------------

    def events(self, prepared: Prepared) -> JobStream:
        """Queue the job on the engine: its events (closing them cancels the generation)."""
        try:
            prepared.events = self.engine.submit(prepared.job)
        except QueueFull:
            raise Overloaded("the server is busy: too many requests are queued; retry shortly",
                             headers={"Retry-After": "1"}) from None
        except TooLarge as exc:  # no Retry-After: it will not fit later either
            raise Overloaded(f"{exc}; send a shorter prompt or a lower max_tokens, or raise "
                             "ram_budget_bytes") from None
        return prepared.events

    async def complete(self, prepared: Prepared) -> Answer:
        outcome = Outcome()
        events = self.events(prepared)
        try:
            async for event in events:
                self.accounting.observe(prepared, outcome, event)
                if isinstance(event, TextDelta):
                    outcome.text_parts.append(event.text)
                    outcome.logprobs.extend(event.logprobs)
                elif isinstance(event, Failed):
                    raise failure(event)
        finally:
            events.close()  # no-op when finished; stops and frees it otherwise
        assert outcome.finish is not None and outcome.prefilled is not None
        content, calls, finish_reason = content_and_calls(self.family, "".join(outcome.text_parts), prepared,
                                                          outcome.finish, self.metrics.tool_parse_failures.inc)
        self.accounting.record(prepared, outcome, "200", stream=False)
        return Answer(content, calls, finish_reason, usage_of(prepared, outcome),
                      self.answer_logprobs(prepared, outcome.logprobs), outcome.finish.stop_sequence)

    async def stream(self, prepared: Prepared) -> AsyncGenerator[AnswerEvent]:
        """`Started` once the prompt is in, then the text and calls as they are written, then
        `Ended`; Overloaded (before any byte) when the job cannot queue. The one generator
        between the engine and an API's wire events: a client that goes away closes it, which
        cancels the generation, and is counted and logged as 499."""
        outcome = Outcome()
        events = self.events(prepared)
        answer = StreamedAnswer(self.family, prepared, self.token_texts, self.metrics.tool_parse_failures.inc)
        started = False
        try:
            async for engine_event in events:
                self.accounting.observe(prepared, outcome, engine_event)
                if not started:  # the first event: the prompt is in (or the job failed)
                    started = True
                    for event in answer.start(usage_of(prepared, outcome)):
                        yield event
                if isinstance(engine_event, Failed):
                    error = failure(engine_event)
                    self.accounting.record(prepared, outcome, str(error.status_code), stream=True)
                    raise error
                if isinstance(engine_event, TextDelta):
                    for event in answer.write(engine_event):
                        yield event
            assert outcome.finish is not None
            for event in answer.end(outcome.finish, usage_of(prepared, outcome)):
                yield event  # the consumer asks for more once it has sent the end
            self.accounting.record(prepared, outcome, "200", stream=True)
        except (asyncio.CancelledError, GeneratorExit):
            self.record_disconnect(prepared, outcome, stream=True)
            raise
        finally:
            events.close()

    def record_disconnect(self, prepared: Prepared, outcome: Outcome | None = None, *, stream: bool) -> None:
        """The client went away before the response was complete (nginx's 499)."""
        self.accounting.record(prepared, outcome or Outcome(prefilled=prepared.prefilled), "499", stream=stream)


def failure(event: Failed) -> APIError:
    """What the client hears of a generation that failed: a 400 naming the field when its own
    schema was at fault (the grammar ran past a limit), a 503 when the shutdown cut it off, else a 500."""
    if event.shutting_down:
        return ShuttingDown(event.message, headers={"Retry-After": "1"})
    return BadRequest(event.message, param=event.param) if event.param else GenerationFailed(event.message)


def _arguments_chars(arguments: str) -> int:
    """A lower bound on the characters a tool call's `arguments` take in the rendered prompt,
    counted without parsing them: the template parses the JSON and writes it again, which may drop its
    whitespace, `\\/` escapes and turn a `\\uXXXX` escape (6 characters, 12 for a surrogate pair)
    into the one character it names; text that is not JSON is written as it is."""
    blanks = sum(arguments.count(blank) for blank in " \t\n\r")
    return max(0, len(arguments) - blanks - 6 * arguments.count("\\u") - arguments.count("\\/"))


def max_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters one token can stand for. A vocabulary entry's string has one character
    per byte (byte-level BPE) or per character (SentencePiece's `▁` for a space), and a character
    is at least one byte, so no token covers more characters than its entry is long. (This holds
    for tokenizers whose normalizer never deletes characters: every chat model's here.)"""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1
