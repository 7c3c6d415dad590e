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
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.api.generation import (
    Arrival,
    ChunkWire,
    Release,
    check_model,
    parse_model,
    serve_generation,
    stream_answer,
    whole_json,
)
from gateway.api.state import gateway_state
from gateway.errors import BadRequest, ContextLengthExceeded
from gateway.protocol import chat_output
from gateway.protocol.answer import AnswerEvent, Ended, TextWritten
from gateway.protocol.completions import DEFAULT_MAX_TOKENS, CompletionRequest
from gateway.serving.answers import LegacyLogprobs, Prepared
from gateway.serving.runtime import Runtime
from gateway.serving.service import ChatService

router = APIRouter()

@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    async def respond(planned: tuple[CompletionRequest, Prepared], release: Release) -> Response:
        req, prepared = planned
        runtime = gateway_state(request.app).model.loaded()
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
    sampling = req.sampling(logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0)
    params = service.sampling(sampling, len(ids), max_tokens=req.max_tokens, default_max_tokens=DEFAULT_MAX_TOKENS,
                              prompt_param="prompt")
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
    chunks = TextChunks(prepared, runtime.service.system_fingerprint, include_usage)
    return await stream_answer(request, prepared, runtime.service.stream(prepared), ChunkWire(chunks.of), release)


class TextChunks:
    """The answer's text as `text_completion` chunks, the last with the finish reason, then (when
    asked) one with the usage and no choices."""

    def __init__(self, prepared: Prepared, fingerprint: str, include_usage: bool) -> None:
        self.prepared = prepared
        self.fingerprint = fingerprint
        self.include_usage = include_usage
        self.created = int(time.time())
        self.legacy = LegacyLogprobs(prepared.job.params.logprobs)  # text offsets run on over the chunks

    def of(self, event: AnswerEvent) -> list[dict[str, Any]]:
        if isinstance(event, TextWritten):
            return [self._completion([_choice(event.text, None, self.legacy.shape(event.logprobs))])]
        if not isinstance(event, Ended):
            return []
        chunks = [self._completion([_choice("", event.finish_reason, self.legacy.shape(event.logprobs))])]
        if self.include_usage:
            chunks.append(self._completion([], chat_output.usage_dict(event.usage)))
        return chunks

    def _completion(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return _text_completion(self.prepared, self.created, self.fingerprint, choices, usage)


def _text_completion(prepared: Prepared, created: int, fingerprint: str, choices: list[dict[str, Any]],
                     usage: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {"id": prepared.request_id, "object": "text_completion", "created": created,
            "model": prepared.model_name, "choices": choices, "system_fingerprint": fingerprint}
    if usage is not None:
        body["usage"] = usage
    return body


def _choice(text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
