"""Cache management shared by the HTTP routes and the CLI: warming a tool group ahead of traffic,
pinning an entry, and the wire shape of a cache entry. A warmed group is rendered and tokenized
exactly as a chat request's tool group is, so later chat requests with the same system prompt and
tools hit it.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from adapters.base import ChatMessage, ToolGroup, ToolSpec
from gateway.edge.nesting import TooDeep, check_nesting
from gateway.engine import Engine, TooLarge
from gateway.errors import BadRequest, ContextLengthExceeded
from gateway.kvcache.entry import CacheEntry
from gateway.kvcache.keys import PrefixKey
from gateway.kvcache.pins import PinBudgetExceeded
from gateway.kvcache.store import EntryInfo, PrefixStore
from gateway.protocol.chat import ToolIn
from gateway.serving.checks import check_unique_names
from gateway.serving.service import ChatService
from gateway.settings import Settings

# Stands in for the conversation: the cut at the end of the tool group happens just as it does
# for a real chat request (the text after the group starts with the same turn marker).
_PLACEHOLDER_TURN = ChatMessage(role="user", content="warm")
DEFAULT_MAX_SCHEMA_DEPTH: int = Settings.model_fields["max_schema_depth"].default


class WarmRequest(BaseModel):
    """`POST /v1/cache/warm` body, and the file `toolkv cache warm FILE` reads."""

    model_config = ConfigDict(extra="ignore")

    tools: list[ToolIn] = Field(default_factory=list)
    system: str | None = None
    pin: bool = False  # pin the warmed group: never evicted (up to pinned_budget_bytes)


@dataclass(frozen=True, slots=True)
class WarmPlan:
    """A tool group ready to compile: its key (the exact prefix token ids) and its names."""

    key: PrefixKey
    group: ToolGroup


@dataclass(frozen=True, slots=True)
class Warmed:
    digest: str
    group_id: str
    tool_names: tuple[str, ...]
    prefix_tokens: int
    num_bytes: int
    compile_s: float  # spent by this call: 0.0 when the group was already cached
    already_cached: bool
    pinned: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.digest, "object": "toolkv.cache_entry", "group_id": self.group_id,
                "tool_names": list(self.tool_names), "prefix_tokens": self.prefix_tokens,
                "bytes": self.num_bytes, "compile_s": round(self.compile_s, 4),
                "already_cached": self.already_cached, "pinned": self.pinned}


def plan_warm(service: ChatService, request: WarmRequest, max_tools: int,
              max_schema_depth: int = DEFAULT_MAX_SCHEMA_DEPTH) -> WarmPlan:
    """Render and tokenize the group as the chat path does; reject what would never be cached.
    Schemas are depth-checked first: rendering serializes them recursively."""
    _check_depth(request.tools, max_schema_depth)
    tools = [t.to_spec() for t in request.tools]
    _check_tools(tools, request.system, max_tools)
    messages = ([ChatMessage(role="system", content=request.system)] if request.system is not None else [])
    rendered = service.renderer.render([*messages, _PLACEHOLDER_TURN], tools)
    ids, prefix_len = service.tokenize(rendered.text, rendered.prefix_chars)
    _check_prefix_len(prefix_len, service.engine.cache.min_prefix_tokens, service.context_len)
    return WarmPlan(service.engine.cache.key_for(ids[:prefix_len]), rendered.group)


def warm_plan(engine: Engine, plan: WarmPlan) -> Future[Warmed]:
    """Look the group up (RAM, disk) and compute it if absent, on the engine's step loop (other
    requests keep decoding meanwhile). Raises QueueFull, and BadRequest for a group larger
    than the whole KV pool."""
    warmed: Future[Warmed] = Future()

    def done(future: Future[tuple[CacheEntry, bool]]) -> None:
        try:
            entry, already = future.result()
        except Exception as exc:
            warmed.set_exception(exc)
            return
        warmed.set_result(Warmed(plan.key.digest, entry.group_id, entry.tool_names, entry.num_tokens,
                                 entry.num_bytes, 0.0 if already else entry.compile_s, already_cached=already))

    try:
        engine.warm(plan.key, plan.group.group_id, plan.group.tool_names).add_done_callback(done)
    except TooLarge as exc:  # it would wait forever, evicting everything else while it waits
        raise BadRequest(f"{exc}; raise ram_budget_bytes to warm a group this large", param="tools") from None
    return warmed


def pin_entry(store: PrefixStore, digest: str, budget_bytes: int, param: str = "id") -> EntryInfo | None:
    """Pin the entry (None: there is none); past `budget_bytes` pinned, a 400 naming the setting."""
    try:
        return store.pin(digest, budget_bytes)
    except PinBudgetExceeded as exc:
        raise BadRequest(f"cannot pin {digest}: {exc}; unpin another group (DELETE /v1/cache/ID/pin) "
                         "or raise pinned_budget_bytes", param=param, code="pinned_budget_exceeded") from None


def entry_dict(info: EntryInfo) -> dict[str, Any]:
    return {"id": info.digest, "object": "toolkv.cache_entry", "group_id": info.group_id,
            "tool_names": list(info.tool_names), "prefix_tokens": info.num_tokens,
            "bytes": info.num_bytes, "tier": info.tiers[0], "tiers": list(info.tiers),
            "hits": info.hits, "created_at": round(info.created_at, 3),
            "last_used_at": round(info.last_used_at, 3), "pinned": info.pinned,
            "retained_until": round(info.retain_until, 3) if info.retain_until else None}


def _check_depth(tools: list[ToolIn], limit: int) -> None:
    for index, tool in enumerate(tools):
        try:
            check_nesting(tool.function.parameters, limit, f"the parameters schema of tool '{tool.function.name}'")
        except TooDeep as exc:
            raise BadRequest(str(exc), param=f"tools[{index}].function.parameters") from None


def _check_tools(tools: list[ToolSpec], system: str | None, max_tools: int) -> None:
    if not tools and system is None:
        raise BadRequest("nothing to warm: send 'tools' (and optionally 'system')", param="tools")
    if len(tools) > max_tools:
        raise BadRequest(f"{len(tools)} tools; the limit is {max_tools}", param="tools")
    check_unique_names(tools)


def _check_prefix_len(prefix_len: int, min_tokens: int, context_len: int) -> None:
    if prefix_len == 0:
        raise BadRequest("this model's chat template does not let the tool group be cut off "
                         "as a prefix, so it cannot be cached", param="tools")
    if prefix_len < min_tokens:
        raise BadRequest(f"the tool group is {prefix_len} tokens; groups shorter than "
                         f"min_prefix_tokens ({min_tokens}) are not cached", param="tools")
    if prefix_len >= context_len:
        raise ContextLengthExceeded(f"the tool group is {prefix_len} tokens; this model's context "
                                    f"is {context_len} tokens", param="tools")
