"""What the proxy reads in a request body and changes before forwarding it: the tool group it is
routed by (the local path's `ToolGroup`: leading system text + tools; or the client's
`prompt_cache_key`, when it sends one), the tools in canonical
order (so an upstream's own prefix cache sees one prompt head whatever order clients send), the
tenant's `cache_salt` (vLLM's per-request prefix-cache namespace), and usage asked of a stream
(for the hit/miss metrics). Everything else goes through as the client sent it: the upstream
validates it and answers for it.

A Messages API request (`/v1/messages`) has the group its chat translation has (gateway/protocol/
messages.py): `system`, then any leading system messages, and the tools with their
`input_schema` as parameters, so it is routed where the equivalent chat request is and shares its
prefix there. Its streams report usage without being asked."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from adapters.base import ToolGroup, ToolSpec, canonical_rank
from gateway.errors import BadRequest
from gateway.settings import Settings

Kind = Literal["chat", "completions", "responses", "messages"]
PATHS: dict[Kind, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
                          "responses": "/v1/responses", "messages": "/v1/messages"}
SYSTEM_ROLES = ("system", "developer")
PROMPT_HEAD_CHARS = 1024  # a text completion has no tool group: it is routed by its prompt's head


@dataclass(frozen=True, slots=True)
class Forward:
    """A request as it goes upstream."""

    kind: Kind
    body: bytes
    group_id: str
    salt: str  # the tenant's cache salt for this group ("" = the shared namespace)
    stream: bool
    client_usage: bool  # the client asked for the stream's usage chunk (else the proxy drops it)
    previous_response_id: str | None = None  # a Responses follow-up: goes first where that one is stored
    cache_key: str | None = None  # the client's `prompt_cache_key`: routed by it instead of the group

    @property
    def path(self) -> str:
        return PATHS[self.kind]


def shape(kind: Kind, data: dict[str, Any], settings: Settings, salt_for: Callable[[str], str]) -> Forward:
    """`data` (the client's body, modified in place) as it goes upstream."""
    _check_counts(data, settings)
    group_id = _group_id(kind, data)
    salt = salt_for(group_id)
    if settings.upstream_cache_salt == "tenant":
        data.pop("cache_salt", None)  # a client never picks its namespace
        if salt:
            data["cache_salt"] = salt
    stream = data.get("stream") is True
    client_usage = kind in ("responses", "messages") or _asks_usage(data)
    if stream and not client_usage:
        options = data.get("stream_options")
        data["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    previous = data.get("previous_response_id") if kind == "responses" else None
    cache_key = data.get("prompt_cache_key")
    return Forward(kind, orjson.dumps(data), group_id, salt, stream, client_usage,
                   previous if isinstance(previous, str) else None,
                   cache_key if isinstance(cache_key, str) and cache_key else None)


def _asks_usage(data: dict[str, Any]) -> bool:
    options = data.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _check_counts(data: dict[str, Any], settings: Settings) -> None:
    for field, limit in (("messages", settings.max_messages), ("input", settings.max_messages),
                         ("tools", settings.max_tools)):
        value = data.get(field)
        if isinstance(value, list) and len(value) > limit:
            raise BadRequest(f"{len(value)} {field}; the limit is {limit}", param=field)


def _group_id(kind: Kind, data: dict[str, Any]) -> str:
    if kind == "completions":
        return _prompt_head_id(data.get("prompt"))
    specs = _canonical_tools(data, kind)
    if kind == "messages":
        return ToolGroup.of(_messages_system(data), specs).group_id
    system = _instructions_and_system(data) if kind == "responses" else _leading_system(data.get("messages"))
    return ToolGroup.of(system, specs).group_id


def _canonical_tools(data: dict[str, Any], kind: Kind) -> list[ToolSpec]:
    """The tools as specs; the body's `tools` sorted into canonical order when every one is a
    function tool (anything else is left as sent, for the upstream to judge)."""
    tools = data.get("tools")
    if not isinstance(tools, list):
        return []
    specs = [_messages_spec(tool) if kind == "messages" else _spec(tool, kind == "responses") for tool in tools]
    known = [spec for spec in specs if spec is not None]
    if len(known) == len(tools):
        order = sorted(range(len(tools)), key=lambda i: canonical_rank(known[i]))
        data["tools"] = [tools[i] for i in order]
    return known


def _spec(tool: Any, flat: bool) -> ToolSpec | None:
    function = tool if flat else (tool.get("function") if isinstance(tool, dict) else None)
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
        return None
    name, description, parameters = function.get("name"), function.get("description"), function.get("parameters")
    if not isinstance(name, str) or not isinstance(description, str | None) or not isinstance(parameters, dict | None):
        return None
    return ToolSpec(name=name, description=description, parameters=parameters)


def _messages_spec(tool: Any) -> ToolSpec | None:
    """A Messages tool (`{name, description, input_schema}`, type absent or `custom`) as the spec of
    the chat function it becomes."""
    if not isinstance(tool, dict) or tool.get("type") not in ("custom", None):
        return None
    return _spec({"name": tool.get("name"), "description": tool.get("description"),
                  "parameters": tool.get("input_schema")}, flat=True)


def _messages_system(data: dict[str, Any]) -> str | None:
    """A Messages request's system text: `system`, then its leading system messages."""
    system = data.get("system")
    head = [_text(system)] if isinstance(system, str | list) else []
    rest = _leading_system(data.get("messages"))
    texts = head + ([rest] if rest is not None else [])
    return "\n\n".join(texts) if texts else None


def _leading_system(messages: Any) -> str | None:
    """The local path's system text: the leading system (or developer) messages, joined."""
    texts: list[str] = []
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict) or message.get("role") not in SYSTEM_ROLES:
            break
        texts.append(_text(message.get("content")))
    return "\n\n".join(texts) if texts else None


def _instructions_and_system(data: dict[str, Any]) -> str | None:
    """A Responses request's system text: `instructions`, then the input's leading system items."""
    instructions = data.get("instructions")
    head = [instructions] if isinstance(instructions, str) else []
    items = data.get("input")
    system = _leading_system(items) if isinstance(items, list) else None
    texts = head + ([system] if system is not None else [])
    return "\n\n".join(texts) if texts else None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


def _prompt_head_id(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    head = prompt[:PROMPT_HEAD_CHARS] if isinstance(prompt, str | list) else None
    blob = orjson.dumps(head) if head is not None else b""
    return "tp_" + hashlib.sha256(blob).hexdigest()[:16]
