"""Cache management shared by the HTTP routes, the CLI and start-up: warming a tool group ahead of
traffic (from a request body, or a file as `toolkv cache warm` and the `warm_groups` /
`pinned_groups` settings name), pinning and unpinning an entry (a change the cache dir refuses is
a 507 the client sees, never a 200 lost at the next start), and the wire shape of a cache entry. A warmed
group is rendered and tokenized exactly as a chat request's tool group is, so later chat requests
with the same system prompt and tools hit it.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from adapters.base import ChatMessage, ToolGroup, ToolSpec
from adapters.render import RenderError
from gateway.edge.limits import MAX_DOCUMENT_DEPTH, TooDeep, check_nesting
from gateway.engine import Engine, TooLarge
from gateway.errors import APIError, BadRequest, ContextLengthExceeded
from gateway.kvcache.entry import CacheEntry, PrefixKey
from gateway.kvcache.pins import PinBudgetExceeded, PinsNotSaved
from gateway.kvcache.store import EntryInfo
from gateway.protocol.chat import ToolIn
from gateway.serving.output_grammar import check_unique_names
from gateway.serving.service import ChatService
from gateway.serving.store_admin import StoreAdmin
from gateway.settings import Settings, SettingsError

log = logging.getLogger(__name__)
# Stands in for the conversation: the cut at the end of the tool group happens just as it does
# for a real chat request (the text after the group starts with the same turn marker).
_PLACEHOLDER_TURN = ChatMessage(role="user", content="warm")
DEFAULT_MAX_SCHEMA_DEPTH: int = Settings.model_fields["max_schema_depth"].default


class WarmRequest(BaseModel):
    """`POST /v1/cache/warm` body, and the file `toolkv cache warm FILE` reads."""

    model_config = ConfigDict(extra="ignore")

    tools: list[ToolIn] = Field(default_factory=list)
    system: str | None = None
    pin: bool = Field(False, strict=True)  # pin the warmed group: never evicted (up to pinned_budget_bytes)


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
    messages.append(_PLACEHOLDER_TURN)
    rendered = service.renderer.render(messages, tools)
    ids, prefix_len, _ = service.encode_prompt(messages, tools, rendered)  # as a request's: the same key
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


class PinNotSaved(APIError):
    """A pin or unpin the cache dir refused (read-only, full): nothing changed. Said as 507
    (Insufficient Storage): the server cannot record it, and a pin kept in memory alone would be
    lost at the next start and unseen by the other processes on the dir."""

    status_code = 507
    error_type = "server_error"
    default_code = "pin_not_saved"


def pin_entry(store: StoreAdmin, digest: str, budget_bytes: int, param: str = "id") -> EntryInfo | None:
    """Pin the entry (None: there is none); past `budget_bytes` pinned, a 400 naming the setting;
    a cache dir that refuses it, a 507."""
    try:
        return store.pin(digest, budget_bytes)
    except PinBudgetExceeded as exc:
        raise BadRequest(f"cannot pin {digest}: {exc}; unpin another group (DELETE /v1/cache/ID/pin) "
                         "or raise pinned_budget_bytes", param=param, code="pinned_budget_exceeded") from None
    except PinsNotSaved as exc:
        raise _not_saved("pin", exc, param) from None


def unpin_entry(store: StoreAdmin, digest: str) -> EntryInfo | None:
    """Unpin the entry (None: there is none); a cache dir that refuses it, a 507 (still pinned)."""
    try:
        return store.unpin(digest)
    except PinsNotSaved as exc:
        raise _not_saved("unpin", exc, "id") from None


def _not_saved(action: str, exc: PinsNotSaved, param: str) -> PinNotSaved:
    return PinNotSaved(f"cannot {action}: {exc}; make the cache dir (cache_dir) writable or give it room, "
                       "then retry", param=param)


# ---- groups named in files (`toolkv cache warm FILE`, warm_groups, pinned_groups) ----------------


class WarmFileError(ValueError):
    """A warm file that cannot be used; the message names the file and what is wrong."""


def read_warm_file(path: Path, max_schema_depth: int) -> WarmRequest:
    """The file's tools and system prompt (`{"tools": [...], "system": "..."}` or a list of tools).
    Nesting is measured before pydantic (or anything recursive) sees the data."""
    try:
        data = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise WarmFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError as exc:
        if "recursion" in str(exc).lower() or "depth" in str(exc).lower():  # orjson stops at 1,024 levels
            raise WarmFileError(f"{path}: the file nests deeper than {MAX_DOCUMENT_DEPTH} levels") from None
        raise WarmFileError(f"{path} is not valid JSON: {exc}") from None
    if isinstance(data, list):
        data = {"tools": data}
    if not isinstance(data, dict):
        raise WarmFileError(f'{path}: expected {{"tools": [...], "system": "..."}} or a list of tools')
    _check_file_depth(path, data, max_schema_depth)
    try:
        return WarmRequest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the file"
        raise WarmFileError(f"{path}: {where}: {first['msg']}") from None


@dataclass(frozen=True, slots=True)
class ConfiguredGroup:
    """A group a setting names: warmed at start-up, and pinned when it is in `pinned_groups` (or
    its file says `"pin": true`)."""

    setting: str
    path: Path
    request: WarmRequest

    @property
    def pin(self) -> bool:
        return self.setting == "pinned_groups" or self.request.pin


def read_configured_groups(settings: Settings) -> list[ConfiguredGroup]:
    """The files `pinned_groups` then `warm_groups` name (pinned first: they get the pinned budget
    and the RAM first), each read once; a SettingsError naming the setting for one that cannot be
    used. Read before the model loads, so a wrong path fails at once."""
    groups: list[ConfiguredGroup] = []
    for setting in ("pinned_groups", "warm_groups"):
        for path in getattr(settings, setting):
            if any(group.path == path for group in groups):
                continue
            try:
                groups.append(ConfiguredGroup(setting, path, read_warm_file(path.expanduser(),
                                                                            settings.max_schema_depth)))
            except WarmFileError as exc:
                raise SettingsError(f"setting '{setting}': {exc}") from None
    return groups


def warm_configured(service: ChatService, store: StoreAdmin, groups: list[ConfiguredGroup],
                    settings: Settings) -> None:
    """Warm each group (from disk when cached), pinning those to pin, before the server says it
    is ready. A group this model cannot cache is a SettingsError naming its file; a pin past
    pinned_budget_bytes is a warning (the group stays warmed): pins made through the API since
    may hold the budget, and a server that would not start could not unpin them."""
    for group in groups:
        try:
            plan = plan_warm(service, group.request, settings.max_tools, settings.max_schema_depth)
            warmed = warm_plan(service.engine, plan).result()
        except (APIError, RenderError) as exc:
            raise SettingsError(f"setting '{group.setting}': {group.path}: {exc}") from None
        pinned = group.pin and _pin_configured(store, warmed, group, settings.pinned_budget_bytes)
        log.info("warmed tool group %s from %s (%d tokens, %s)%s", warmed.group_id, group.path,
                 warmed.prefix_tokens, "cached" if warmed.already_cached else f"compiled in {warmed.compile_s:.1f}s",
                 ", pinned" if pinned else "")


def _pin_configured(store: StoreAdmin, warmed: Warmed, group: ConfiguredGroup, budget_bytes: int) -> bool:
    try:
        return store.pin(warmed.digest, budget_bytes) is not None
    except PinBudgetExceeded as exc:
        log.warning("setting '%s': %s is warmed but not pinned: %s; unpin another group (DELETE "
                    "/v1/cache/ID/pin) or raise pinned_budget_bytes", group.setting, group.path, exc)
        return False
    except PinsNotSaved as exc:  # a read-only cache dir still serves: the group stays warmed
        log.warning("setting '%s': %s is warmed but not pinned: %s", group.setting, group.path, exc)
        return False


def _check_file_depth(path: Path, data: dict[str, Any], max_schema_depth: int) -> None:
    try:
        tools = data.get("tools")
        for index, tool in enumerate(tools if isinstance(tools, list) else ()):
            function = tool.get("function") if isinstance(tool, dict) else None
            params = function.get("parameters") if isinstance(function, dict) else None
            check_nesting(params, max_schema_depth, f"tools[{index}].function.parameters")
        check_nesting(data, MAX_DOCUMENT_DEPTH, "the file")
    except TooDeep as exc:
        raise WarmFileError(f"{path}: {exc}") from None


# ---- the wire shape -------------------------------------------------------------------------------


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
