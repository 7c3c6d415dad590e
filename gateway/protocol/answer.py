"""The model's answer as every API renders it, typed and API-neutral: what the serving layer
hands the chat, Responses, Messages and legacy completions routes, whole (`Answer`) or as a
stream of `AnswerEvent`s. Each API shapes these into its own wire format (chat_output.py,
responses_output.py, the Messages and completions routes); none re-reads another API's JSON.

A stream is `Started` (the prompt is in: its usage is known), then in order the text and the
calls as the model writes them (`TextWritten`, `CallStarted` and its `CallArguments`), then
`Ended`. `logprobs` on an event are the chat-shaped entries (`token`, `logprob`, `bytes`,
`top_logprobs`) of the tokens sampled since the previous event that carried any; `None` when the
request did not ask, or when there are none to send yet (text a parser holds back sends its
tokens' entries later, with the event that writes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

FinishReason = Literal["stop", "length", "tool_calls"]
Logprobs = list[dict[str, Any]] | None


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one answer. `cached_tokens`: prompt tokens read from the cache;
    `cache_write_tokens`: prompt tokens this answer wrote to it (the tool group a miss stored)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_write_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class ToolCall:
    call_id: str  # `call_...`, as OpenAI's
    name: str
    arguments: str  # JSON text, as written (cut short when `max_tokens` ended the answer)


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer. `content` is None when the model wrote only calls (or nothing before
    them); `stop_sequence` is the client's stop string that ended it, if one did."""

    content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: FinishReason
    usage: Usage
    logprobs: Logprobs = None  # every token's entry, when asked
    stop_sequence: str | None = None


# ---- streamed ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Started:
    """The prompt is in (the first token is on its way). `forced_call`: `tool_choice` forced a
    call, so the answer is only calls and has no text."""

    prompt: Usage  # the prompt's counts (completion_tokens 0)
    forced_call: bool


@dataclass(frozen=True, slots=True)
class TextWritten:
    text: str
    logprobs: Logprobs = None


@dataclass(frozen=True, slots=True)
class CallStarted:
    index: int  # the call's place among this answer's calls, from 0
    call_id: str
    name: str
    logprobs: Logprobs = None


@dataclass(frozen=True, slots=True)
class CallArguments:
    index: int
    fragment: str  # the next piece of the call's JSON arguments
    logprobs: Logprobs = None


@dataclass(frozen=True, slots=True)
class Ended:
    finish_reason: FinishReason
    usage: Usage
    logprobs: Logprobs = None  # entries no earlier event carried (e.g. the end token's)
    stop_sequence: str | None = None


AnswerEvent = Started | TextWritten | CallStarted | CallArguments | Ended
