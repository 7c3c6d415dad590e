"""One streaming path for the four APIs (gateway/api/streaming.py): each streamed chunk passes
through at most two async generators between the engine and the wire (the service's `stream`
and the stream helper's), counted on a real server as each engine event is read."""

from __future__ import annotations

import inspect
import sys
from typing import Any

import httpx
import pytest

from gateway.engine.events import EngineEvent, JobStream
from tests.support.server import LiveServer

MESSAGES = [{"role": "user", "content": "Say hi"}]
STREAMED: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 4, "stream": True},
    "/v1/completions": {"prompt": "Say hi", "max_tokens": 4, "stream": True},
    "/v1/messages": {"messages": MESSAGES, "max_tokens": 4, "stream": True},
    "/v1/responses": {"input": "Say hi", "max_output_tokens": 16, "stream": True},
}


def _async_generators_awaiting() -> int:
    """How many async generator frames are waiting on the caller (the frames of an await chain
    are linked while it runs)."""
    frame, count = sys._getframe(1), 0
    while frame is not None:
        count += bool(frame.f_code.co_flags & inspect.CO_ASYNC_GENERATOR)
        frame = frame.f_back  # type: ignore[assignment]
    return count


@pytest.mark.parametrize("path", STREAMED)
def test_a_streamed_chunk_passes_through_at_most_two_generators(live: LiveServer, path: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    depths: list[int] = []
    read = JobStream.__anext__

    async def counted(self: JobStream) -> EngineEvent:
        event = await read(self)
        depths.append(_async_generators_awaiting())
        return event

    monkeypatch.setattr(JobStream, "__anext__", counted)
    with httpx.stream("POST", live.base_url + path, json={"model": "tiny-llama", **STREAMED[path]},
                      timeout=120) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert len(lines) > 2
    assert len(depths) >= 3  # the prefill, text, the finish
    assert max(depths) <= 2, depths
