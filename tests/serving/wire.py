"""Raw HTTP helpers: what goes over the wire, before any SDK reshapes it."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx

from tests.support.server import LiveServer


def post(live: LiveServer, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    resp = httpx.post(live.api_url + "/chat/completions", json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def stream(live: LiveServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks of a streamed completion (without the final [DONE])."""
    with httpx.stream("POST", live.api_url + "/chat/completions", json={**body, "stream": True},
                      timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def assemble(chunks: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """(content, tool_calls, finish_reason) spelled out by stream chunks, as an SDK accumulates them."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for part in delta.get("tool_calls") or ():
                call = calls.setdefault(part["index"], {"id": None, "type": None,
                                                       "function": {"name": None, "arguments": ""}})
                call["id"] = part.get("id", call["id"])
                call["type"] = part.get("type", call["type"])
                call["function"]["name"] = part.get("function", {}).get("name", call["function"]["name"])
                call["function"]["arguments"] += part.get("function", {}).get("arguments", "")
            finish = choice["finish_reason"] or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def parse_failures(live: LiveServer) -> float:
    text = httpx.get(live.base_url + "/metrics", timeout=30).text
    found = re.search(r"^toolkv_tool_call_parse_failures_total (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0
