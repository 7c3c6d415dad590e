"""`POST /v1/completions`: OpenAI's legacy text completions, whole and streamed.

The prompt is tokenized as it is (no chat template) into an engine job with no tool group, and
runs through the chat service like any job: batching, conversation reuse of an earlier prompt's
KV (`usage.prompt_tokens_details.cached_tokens`), keys, quotas, the cache headers. The chat
service's answer (a completion or its stream's chunks) is reshaped into `text_completion`
objects. As in protocol.py, fields toolkv does not implement are a 400 naming the field unless
they hold a value that asks for nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.api.generation import (
    CLIENT_CLOSED_REQUEST,
    GONE,
    Arrival,
    Release,
    check_model,
    parse_model,
    serve_generation,
    sse_data,
    sse_response,
    unless_disconnected,
    whole_json,
)
from gateway.engine.sampling import SamplingParams
from gateway.errors import BadRequest, ContextLengthExceeded
from gateway.protocol.chat import (
    INT64_MAX,
    INT64_MIN,
    MAX_TOKENS_LIMIT,
    StreamOptions,
    UnsupportedField,
    check_logit_bias,
)
from gateway.serving.jobs import Prepared
from gateway.serving.logprobs import LegacyLogprobs
from gateway.serving.runtime import Runtime, loaded_runtime
from gateway.serving.service import ChatService

router = APIRouter()

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint
MAX_LOGPROBS = 5  # OpenAI's limit for this endpoint

# Fields that are not implemented, each with the values that ask for nothing (accepted).
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "suffix": lambda v: v == "",
    "best_of": lambda v: v == 1 and not isinstance(v, bool),
    "echo": lambda v: v is False,
}


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # vendor extras ignored, known keys strict

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    prompt_cache_key: str | None = None  # accepted; routes the request in proxy mode
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # how many alternatives per token
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, is_noop in UNSUPPORTED_FIELDS.items():
                value = data.get(name)
                if value is not None and not is_noop(value):
                    raise UnsupportedField(name)
        return data

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str] | list[int] | list[list[int]]) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt is empty")
        if isinstance(prompt, list) and isinstance(prompt[0], str | list) and len(prompt) != 1:
            raise ValueError("only one prompt per request is supported")
        return prompt

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop sequences")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        return check_logit_bias(bias)

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return tuple(s for s in stops if s)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    async def respond(planned: tuple[CompletionRequest, Prepared], release: Release) -> Response:
        req, prepared = planned
        runtime = loaded_runtime(request.app.state)
        if not req.stream:
            return await whole_json(request, runtime, prepared, _whole(runtime.service, prepared))
        return await _streamed(request, runtime, prepared, req.include_usage, release)

    return await serve_generation(request, f"cmpl-{uuid.uuid4().hex}", _plan, respond)


def _plan(arrival: Arrival) -> tuple[CompletionRequest, Prepared]:
    """Parse, tokenize and build the engine job (on a prepare thread)."""
    req = parse_model(arrival.body, CompletionRequest)
    check_model(arrival.runtime, req.model)
    service = arrival.runtime.service
    ids = _prompt_ids(service, req.prompt)
    prepared = service.prepare_ids(ids, _sampling(service, req, len(ids)), bypass=arrival.bypass,
                                   received=arrival.received, tenant=arrival.tenant.salt,
                                   request_id=arrival.request_id)
    return req, prepared


def _prompt_ids(service: ChatService, prompt: str | list[str] | list[int] | list[list[int]]) -> list[int]:
    """The prompt's token ids: text tokenized as it is (with the tokenizer's own special tokens,
    as vLLM does), or the ids the client sent, each checked against the vocabulary."""
    if isinstance(prompt, list) and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if len(prompt) > service.context_len * service.max_token_chars:  # over the context whatever it tokenizes to
            raise ContextLengthExceeded(f"the prompt holds {len(prompt)} characters, more than this model's "
                                        f"context of {service.context_len} tokens can take", param="prompt")
        ids: list[int] = service.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    else:
        ids = [int(token) for token in prompt]  # a list of ints, by validation
        vocab = len(service.tokenizer)
        if any(not 0 <= token < vocab for token in ids):
            raise BadRequest(f"the prompt holds a token id outside this model's vocabulary (0..{vocab - 1})",
                             param="prompt")
    if not ids:
        raise BadRequest("the prompt is empty", param="prompt")
    return ids


def _sampling(service: ChatService, req: CompletionRequest, prompt_len: int) -> SamplingParams:
    room = service.context_len - prompt_len
    if room < 1:
        raise ContextLengthExceeded(f"the prompt is {prompt_len} tokens; this model's context is "
                                    f"{service.context_len} tokens", param="prompt")
    if req.max_tokens is not None and req.max_tokens > room:
        raise ContextLengthExceeded(f"prompt ({prompt_len} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                                    f"context of {service.context_len} tokens", param="max_tokens")
    return SamplingParams(max_tokens=min(req.max_tokens or DEFAULT_MAX_TOKENS, room),
                          temperature=1.0 if req.temperature is None else req.temperature,
                          top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, stop=req.stop_sequences,
                          logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0,
                          frequency_penalty=req.frequency_penalty or 0.0,
                          presence_penalty=req.presence_penalty or 0.0, logit_bias=service.logit_bias(req.logit_bias))


async def _whole(service: ChatService, prepared: Prepared) -> dict[str, Any]:
    chat = await service.complete(prepared)
    choice = chat["choices"][0]
    body = _text_completion(chat, [_choice(choice["message"]["content"] or "", choice["finish_reason"],
                                           LegacyLogprobs(prepared.job.params.logprobs).shape(choice["logprobs"]))])
    body["usage"] = chat["usage"]
    return body


async def _streamed(request: Request, runtime: Runtime, prepared: Prepared, include_usage: bool,
                    release: Release) -> Response:
    state = request.app.state
    chunks = runtime.service.stream(prepared, include_usage)
    # Errors before the first byte are plain HTTP errors; a client that leaves while its stream is
    # still queued cancels it (the stream records its own 499).
    first = await unless_disconnected(request, anext(chunks))
    if first is GONE:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    legacy = LegacyLogprobs(prepared.job.params.logprobs)  # text offsets run on over the chunks
    events = sse_data(_text_chunk(first, legacy), _text_chunks(chunks, legacy), state.metrics, prepared.request_id)
    return sse_response(state, prepared, events, release)


async def _text_chunks(chunks: AsyncIterator[dict[str, Any]], legacy: LegacyLogprobs) -> AsyncIterator[dict[str, Any]]:
    async for chunk in chunks:
        text_chunk = _text_chunk(chunk, legacy)
        if text_chunk is not None:
            yield text_chunk


def _text_chunk(chunk: dict[str, Any], legacy: LegacyLogprobs) -> dict[str, Any] | None:
    """A chat stream chunk as a `text_completion` chunk; None for one that carries nothing
    here (the assistant role that opens a chat stream)."""
    choices = []
    for choice in chunk["choices"]:
        text, finish = choice["delta"].get("content") or "", choice["finish_reason"]
        if text or finish is not None:
            choices.append(_choice(text, finish, legacy.shape(choice["logprobs"])))
    if not choices and "usage" not in chunk:
        return None
    out = _text_completion(chunk, choices)
    if "usage" in chunk:
        out["usage"] = chunk["usage"]
    return out


def _text_completion(chat: dict[str, Any], choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": chat["id"], "object": "text_completion", "created": chat["created"], "model": chat["model"],
            "choices": choices, "system_fingerprint": chat["system_fingerprint"]}


def _choice(text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
