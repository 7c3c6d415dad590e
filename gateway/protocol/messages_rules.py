"""What Anthropic's Messages API refuses that the request's types cannot say, refused here the same
way (a 400 `invalid_request_error`, in Anthropic's words) rather than answered as if honoured:

- at most 4 `cache_control` breakpoints (the top-level one, automatic caching, takes a slot);
- breakpoints read in the order `tools`, `system`, `messages` (the top-level one last), a longer
  `ttl` never after a shorter one (no `ttl` is `5m`);
- no empty text block anywhere, and no whitespace-only one in `system` or a user turn (an
  assistant turn's is accepted: a model served here may write only blank text before its calls,
  and the SDKs send a reply back as it came); a message's string content not empty;
- every stop sequence holds a non-whitespace character.

A thread's stored turns are not checked again (gateway/api/threads.py): they passed when sent."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from gateway.protocol.fields import InvalidValue

if TYPE_CHECKING:
    from gateway.protocol.messages import MessagesRequest

MAX_BREAKPOINTS = 4
TTL_RANK = {"1h": 1, "5m": 0}
TTL_ORDER_RULE = ("a ttl='{later}' cache_control block must not come after a ttl='{earlier}' cache_control block. "
                  "Note that blocks are processed in the following order: `tools`, `system`, `messages`.")
BLANK_TEXT = "text content blocks must contain non-whitespace text"


def check_rules(req: MessagesRequest) -> None:
    _check_stop_sequences(req.stop_sequences or [])
    _check_text(req)
    _check_breakpoints(list(_breakpoints(req)))


def _check_stop_sequences(stops: list[str]) -> None:
    if any(not stop.strip() for stop in stops):
        raise InvalidValue("stop_sequences", "stop_sequences: each stop sequence must contain non-whitespace")


def _check_text(req: MessagesRequest) -> None:
    if isinstance(req.system, list) and any(not block.text.strip() for block in req.system):
        raise InvalidValue("system", f"system: {BLANK_TEXT}")
    for index, message in enumerate(req.messages):
        where = f"messages[{index}]"
        if message.content == "":
            raise InvalidValue(where, f"{where}: all messages must have non-empty content except for the optional "
                                      "final assistant message")
        for path, block in _blocks(message.content, where):
            if block.type == "text" and not (block.text.strip() if message.role != "assistant" else block.text):
                raise InvalidValue(f"{path}.text", f"{path}.text: {BLANK_TEXT}")


def _check_breakpoints(marks: list[tuple[str, str]]) -> None:
    if len(marks) > MAX_BREAKPOINTS:
        raise InvalidValue("cache_control", f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be "
                                            f"provided. Found {len(marks)}.")
    shortest = "1h"
    for path, ttl in marks:
        if TTL_RANK[ttl] > TTL_RANK[shortest]:
            raise InvalidValue(f"{path}.ttl", f"{path}.ttl: " + TTL_ORDER_RULE.format(later=ttl, earlier=shortest))
        shortest = ttl


def _breakpoints(req: MessagesRequest) -> Iterator[tuple[str, str]]:
    """Every breakpoint as (where, ttl), in the order Anthropic reads them."""
    for index, tool in enumerate(req.tools or ()):
        yield from _mark(tool, f"tools[{index}]")
    for index, block in enumerate(req.system if isinstance(req.system, list) else ()):
        yield from _mark(block, f"system[{index}]")
    for index, message in enumerate(req.messages):
        for path, block in _blocks(message.content, f"messages[{index}]"):
            yield from _mark(block, path)
    yield from _mark(req, "")


def _blocks(content: Any, where: str) -> Iterator[tuple[str, Any]]:
    """A message's blocks, a tool result's own text blocks before the result itself."""
    for index, block in enumerate(content if isinstance(content, list) else ()):
        path = f"{where}.content[{index}]"
        inner = getattr(block, "content", None)
        for i_index, part in enumerate(inner if isinstance(inner, list) else ()):
            yield f"{path}.content[{i_index}]", part
        yield path, block


def _mark(holder: Any, path: str) -> Iterator[tuple[str, str]]:
    mark = getattr(holder, "cache_control", None)
    if mark is not None:
        yield (f"{path}.cache_control" if path else "cache_control"), mark.ttl or "5m"
