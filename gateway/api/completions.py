"""`POST /v1/completions`: OpenAI's legacy text completions, whole and streamed.

The prompt is tokenized as it is (no chat template) into an engine job with no tool group, and
runs through the chat service like any job: batching, conversation reuse of an earlier prompt's
KV (`usage.prompt_tokens_details.cached_tokens`), keys, quotas, the cache headers. The service's
typed answer (whole, or its events) is shaped into `text_completion` objects. The request model
is gateway/protocol/completions.py. Having no tool group, a completion has nothing for
`prompt_cache_retention` to keep: the hint is accepted and changes nothing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

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
from gateway.errors import BadRequest, ContextLengthExceeded
from gateway.protocol import chat_output
from gateway.protocol.answer import AnswerEvent, Ended, TextWritten
from gateway.protocol.completions import DEFAULT_MAX_TOKENS, CompletionRequest
from gateway.serving.answers import chain
from gateway.serving.jobs import Prepared
from gateway.serving.logprobs import LegacyLogprobs
from gateway.serving.runtime import Runtime, loaded_runtime
from gateway.serving.service import ChatService

router = APIRouter()

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
    params = service.sampling(req, len(ids), max_tokens=req.max_tokens, default_max_tokens=DEFAULT_MAX_TOKENS,
                              prompt_param="prompt", logprobs=req.logprobs is not None,
                              top_logprobs=req.logprobs or 0)
    prepared = service.prepare_ids(ids, params, bypass=arrival.bypass, received=arrival.received,
                                   tenant=arrival.tenant.salt, request_id=arrival.request_id)
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


async def _whole(service: ChatService, prepared: Prepared) -> dict[str, Any]:
    answer = await service.complete(prepared)
    logprobs = LegacyLogprobs(prepared.job.params.logprobs).shape(answer.logprobs)
    body = _text_completion(prepared, int(time.time()), service.system_fingerprint,
                            [_choice(answer.content or "", answer.finish_reason, logprobs)])
    body["usage"] = chat_output.usage_dict(answer.usage)
    return body


async def _streamed(request: Request, runtime: Runtime, prepared: Prepared, include_usage: bool,
                    release: Release) -> Response:
    state = request.app.state
    events = runtime.service.stream(prepared)
    # Errors before the first byte are plain HTTP errors; a client that leaves while its stream is
    # still queued cancels it (the stream records its own 499).
    first = await unless_disconnected(request, anext(events))
    if first is GONE:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    chunks = _text_chunks(prepared, runtime.service.system_fingerprint, chain(first, events), include_usage)
    return sse_response(state, prepared, sse_data(None, chunks, state.metrics, prepared.request_id), release)


async def _text_chunks(prepared: Prepared, fingerprint: str, events: AsyncIterator[AnswerEvent],
                       include_usage: bool) -> AsyncIterator[dict[str, Any]]:
    """The answer's text as `text_completion` chunks, the last with the finish reason, then (when
    asked) one with the usage and no choices."""
    created = int(time.time())
    legacy = LegacyLogprobs(prepared.job.params.logprobs)  # text offsets run on over the chunks
    async for event in events:
        if isinstance(event, TextWritten):
            yield _text_completion(prepared, created, fingerprint,
                                   [_choice(event.text, None, legacy.shape(event.logprobs))])
        elif isinstance(event, Ended):
            yield _text_completion(prepared, created, fingerprint,
                                   [_choice("", event.finish_reason, legacy.shape(event.logprobs))])
            if include_usage:
                yield _text_completion(prepared, created, fingerprint, [], chat_output.usage_dict(event.usage))


def _text_completion(prepared: Prepared, created: int, fingerprint: str, choices: list[dict[str, Any]],
                     usage: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {"id": prepared.request_id, "object": "text_completion", "created": created,
            "model": prepared.model_name, "choices": choices, "system_fingerprint": fingerprint}
    if usage is not None:
        body["usage"] = usage
    return body


def _choice(text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
