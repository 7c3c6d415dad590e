"""OpenAI's legacy text-completions request (`POST /v1/completions`): the fields it shares with
chat (sampling, stops, streaming, cache hints) validated as chat's, the prompt (text or token
ids, one per request), `logprobs` as a count of alternatives. As for chat, fields toolkv does
not implement are a 400 naming the field unless they hold a value that asks for nothing."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator

from gateway.protocol.fields import SamplingFields

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint
MAX_LOGPROBS = 5  # OpenAI's limit for this endpoint

# Fields that are not implemented, each with the values that ask for nothing (accepted).
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "suffix": lambda v: v == "",
    "best_of": lambda v: v == 1 and not isinstance(v, bool),
    "echo": lambda v: v is False,
}


class CompletionRequest(SamplingFields):
    unsupported: ClassVar[dict[str, Any]] = UNSUPPORTED_FIELDS
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # how many alternatives per token

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str] | list[int] | list[list[int]]) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt is empty")
        if isinstance(prompt, list) and isinstance(prompt[0], str | list) and len(prompt) != 1:
            raise ValueError("only one prompt per request is supported")
        return prompt
