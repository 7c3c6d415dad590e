"""A scripted OpenAI-compatible upstream (with a streamed Anthropic Messages API) for what a real
toolkv cannot be made to do on cue: it records every request that reaches it (body and headers),
can hold requests until the test releases them, answer with a status, or break its stream off;
says on /version that it takes toolkv's tenant header (or not); and misbehaves on cue: headers a
client must not see, a body or an event larger than a bound, a compressed answer, a stream of
keep-alive comments alone."""

from __future__ import annotations

import asyncio
import gzip
import socketserver
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.settings import load_settings

HOLD_LIMIT_S = 60.0  # a test that forgets to release fails instead of hanging


@dataclass
class Arrival:
    upstream: str
    body: dict[str, Any]
    headers: dict[str, str]


class Arrivals:
    """Requests as they reach any of the fake upstreams, in order; a test waits on them."""

    def __init__(self) -> None:
        self.seen: list[Arrival] = []
        self._changed = threading.Condition()

    def record(self, arrival: Arrival) -> None:
        with self._changed:
            self.seen.append(arrival)
            self._changed.notify_all()

    def wait_for(self, count: int, timeout_s: float = 60.0) -> list[Arrival]:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.seen) >= count, timeout_s), self.seen
            return list(self.seen)


@dataclass
class FakeUpstream:
    name: str
    arrivals: Arrivals
    status: int = 200
    error_code: str | None = None  # the `code` of the error envelope a status other than 200 comes with
    cached_tokens: int = 0
    hold: threading.Event | None = None  # when set: every request waits for it
    break_after: int | None = None  # stream: this many events, then the connection drops
    ping_first: bool = False  # stream: a keep-alive comment before the first event
    like_llama_cpp_python: bool = False  # /health is a 404; a bare 400 unless X-Request-Id is a UUID
    tenant_salt: bool = True  # /version says it takes X-Toolkv-Tenant (as a toolkv that trusts the proxy)
    vllm_version: str | None = None  # /version says this vLLM version, and its models are owned by vllm
    models_status: int = 200  # /v1/models answers this (503: as a toolkv still loading its model)
    extra_headers: dict[str, str] = field(default_factory=dict)  # on every chat answer
    padding: int = 0  # bytes of padding in an answer's content (whole) or its one content event (stream)
    gzipped: bool = False  # a whole answer compressed (Content-Encoding: gzip) whatever was asked
    comments_after: int | None = None  # stream: this many events, then keep-alive comments until the client leaves
    app: FastAPI = field(init=False)
    base_url: str = field(init=False, default="")  # set once it runs

    def __post_init__(self) -> None:
        self.app = FastAPI()
        self.app.state.settings = load_settings(environ={})
        self.app.add_api_route("/health", self._health, methods=["GET"])
        self.app.add_api_route("/version", self._version, methods=["GET"])
        self.app.add_api_route("/v1/models", self._models, methods=["GET"])
        self.app.add_api_route("/v1/chat/completions", self._chat, methods=["POST"])
        self.app.add_api_route("/v1/messages", self._messages, methods=["POST"])

    async def _health(self) -> JSONResponse:
        if self.like_llama_cpp_python:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return JSONResponse({"status": "ok"})

    async def _version(self) -> JSONResponse:
        if self.like_llama_cpp_python:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        if self.vllm_version is not None:
            return JSONResponse({"version": self.vllm_version})
        return JSONResponse({"version": "0.1.0", "tenant_salt": self.tenant_salt})

    async def _models(self) -> JSONResponse:
        if self.models_status != 200:
            return JSONResponse({"error": {"message": "not now", "type": "fake", "param": None, "code": None}},
                                status_code=self.models_status)
        owner = "vllm" if self.vllm_version is not None else "fake"
        return JSONResponse({"object": "list", "data": [{"id": f"model-{self.name}", "object": "model",
                                                         "created": 0, "owned_by": owner}]})

    async def _chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.arrivals.record(Arrival(self.name, body, dict(request.headers)))
        if self.like_llama_cpp_python:
            try:
                uuid.UUID(request.headers.get("x-request-id", ""))
            except ValueError:
                return Response(status_code=400)
        if self.hold is not None:
            assert await asyncio.to_thread(self.hold.wait, HOLD_LIMIT_S), "the test never released the hold"
        if self.status != 200:
            return JSONResponse({"error": {"message": f"{self.name} says {self.status}", "type": "fake",
                                           "param": None, "code": self.error_code}}, status_code=self.status)
        if body.get("stream"):
            return StreamingResponse(self._events(body), media_type="text/event-stream", headers=self.extra_headers)
        answer = orjson.dumps({"id": f"chatcmpl-{self.name}", "object": "chat.completion", "created": 0,
                               "model": body.get("model"), "choices": [{
                                   "index": 0, "message": {"role": "assistant", "content": self._content()},
                                   "finish_reason": "stop", "logprobs": None}], "usage": self._usage()})
        headers = {"content-type": "application/json", **self.extra_headers}
        if self.gzipped:
            answer, headers["content-encoding"] = gzip.compress(answer), "gzip"
        return Response(answer, headers=headers)

    def _content(self) -> str:
        return f"from {self.name}" + " " * self.padding

    async def _events(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        if self.ping_first:
            yield b": ping\n\n"
        for sent, chunk in enumerate(self.chunks(body)):
            if sent == self.break_after:
                raise RuntimeError("the fake upstream drops the connection mid-stream")
            while sent == self.comments_after:
                yield b": still here\n\n"
                await asyncio.sleep(0.02)
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        yield b"data: [DONE]\n\n"

    def chunks(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        def chunk(delta: dict[str, Any] | None, finish: str | None = None) -> dict[str, Any]:
            choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
            return {"id": f"chatcmpl-{self.name}", "object": "chat.completion.chunk", "created": 0,
                    "model": body.get("model"), "choices": choices}

        out = [chunk({"role": "assistant", "content": ""}), chunk({"content": self._content()}),
               chunk({}, "stop")]
        if (body.get("stream_options") or {}).get("include_usage"):
            out.append({**chunk(None), "usage": self._usage()})
        return out

    async def _messages(self, request: Request) -> Response:
        """Anthropic's Messages API, streamed only: its events in Anthropic's order (broken off
        after `break_after` of them)."""
        self.arrivals.record(Arrival(self.name, orjson.loads(await request.body()), dict(request.headers)))
        if self.status != 200:
            return JSONResponse({"type": "error", "error": {"type": "api_error", "message": f"{self.name} says "
                                                            f"{self.status}"}}, status_code=self.status)
        usage = {"input_tokens": 100 - self.cached_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": self.cached_tokens}
        message = {"id": f"msg_{self.name}", "type": "message", "role": "assistant", "model": "fake",
                   "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
        events = [("message_start", {"message": message}),
                  ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
                  ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": self._content()}}),
                  ("content_block_stop", {"index": 0}),
                  ("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                     "usage": {**usage, "output_tokens": 2}}),
                  ("message_stop", {})]

        async def stream() -> AsyncIterator[bytes]:
            for sent, (name, data) in enumerate(events):
                if sent == self.break_after:
                    raise RuntimeError("the fake upstream drops the connection mid-stream")
                yield f"event: {name}\n".encode() + b"data: " + orjson.dumps({"type": name, **data}) + b"\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    def _usage(self) -> dict[str, Any]:
        return {"prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class RawUpstream:
    """An upstream that answers every POST with `answer`, bytes as they are on the wire (a status
    line no HTTP server library would write), and GET /health with a plain ok."""

    HEALTH = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n{"status":"ok"}'

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> RawUpstream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[socketserver.StreamRequestHandler]:
        upstream = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                head = b""
                while not head.endswith(b"\r\n\r\n") and (line := self.rfile.readline()):
                    head += line
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.rfile.read(length)
                self.wfile.write(upstream.answer if head.startswith(b"POST") else upstream.HEALTH)

        return Handler
