"""One streamed chat request, timed from the client's side.

TTFT is the time from sending the request to the first chunk carrying content or a tool call,
not to the first SSE byte (servers send the role chunk early or late as they like). A request is
a hit when the server reports `cached_tokens > 0`; when it reports no `cached_tokens` at all, the
class the scenario expected is used and the sample says so.

A server that says where its time went (toolkv's W3C `Server-Timing` header) lets each hit be
split exactly: `prefill` is the model's own forward over the suffix, measured inside the server
for this very request, and everything else between sending and the first token is overhead.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

BYPASS_HEADERS = {"X-Toolkv-Cache": "bypass"}
Expected = Literal["miss", "hit", "bypass", "any"]


class ContextTooLong(Exception):
    """The server refused the prompt as longer than the model's context."""


@dataclass(slots=True)
class Sample:
    scenario: str
    group: str
    num_tools: int
    tool_offset: int
    expected: Expected
    bypass: bool
    started_s: float  # since the start of the run
    ttft_s: float | None = None
    first_chunk_s: float | None = None  # the first SSE data line, whatever it carried
    total_s: float = 0.0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    token_chunks: int = 0  # chunks that carried content or a tool call (tokens when there is no usage)
    tool_calls: int = 0  # calls the answer made (each call's first delta carries its id)
    error: str | None = None
    server_timing_ms: dict[str, float] | None = None  # from a Server-Timing header, if any
    client_prep_s: float = 0.0  # the client library's work before the first byte was sent
    tags: dict[str, Any] = field(default_factory=dict)

    @property
    def cache(self) -> str:
        """hit / miss / bypass / error, by cached_tokens (the expected class when it is missing)."""
        if self.error:
            return "error"
        if self.bypass:
            return "bypass"
        if self.cached_tokens is None:
            return "hit" if self.expected == "hit" else "miss"
        return "hit" if self.cached_tokens > 0 else "miss"

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first, per second after the first token."""
        if self.ttft_s is None or not self.completion_tokens or self.completion_tokens < 2:
            return None
        span = self.total_s - self.ttft_s
        return (self.completion_tokens - 1) / span if span > 0 else None

    @property
    def model_prefill_ms(self) -> float | None:
        """The server's own forward time for this request (Server-Timing `prefill`)."""
        return (self.server_timing_ms or {}).get("prefill")

    @property
    def overhead_ms(self) -> float | None:
        """TTFT minus the server's model forward for the same request: all that is not the model."""
        if self.ttft_s is None or self.model_prefill_ms is None:
            return None
        return self.ttft_s * 1000 - self.model_prefill_ms

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        by = "header" if self.bypass else ("cached_tokens" if self.cached_tokens is not None else "expected")
        out.update(cache=self.cache, decode_tokens_per_s=self.decode_tokens_per_s, classified_by=by,
                   overhead_ms=None if self.overhead_ms is None else round(self.overhead_ms, 2))
        return out


class BenchClient:
    """Streams chat completions from an OpenAI-compatible server and times them."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float, clock_zero: float) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.clock_zero = clock_zero
        self._http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0),
                                       limits=httpx.Limits(max_connections=64))

    async def aclose(self) -> None:
        await self._http.aclose()

    def rebase(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    def sibling(self, base_url: str) -> BenchClient:
        """A client of another server with this one's key, timeout and clock (close it too)."""
        return BenchClient(base_url, self.api_key, self.timeout_s, self.clock_zero)

    async def served_model(self) -> str | None:
        """The first model id of GET /v1/models (None if the server does not say)."""
        try:
            resp = await self._http.get(self.api_url("/models"))
            data = resp.json().get("data") or []
            return str(data[0]["id"]) if resp.status_code == 200 and data else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    async def resident_mb(self) -> float | None:
        """The server's resident memory from its /metrics (`process_resident_memory_bytes`), in
        MB; None when the server does not export it."""
        rss = (await self.metrics()).get("process_resident_memory_bytes")
        return None if rss is None else round(rss / 1e6, 1)

    async def metrics(self) -> dict[str, float]:
        """The server's /metrics as {series: value}, a series named as written there, labels and
        all (`toolkv_kv_blocks{state="used"}`); empty when the server has none."""
        try:
            resp = await self._http.get(self.root_url + "/metrics")
        except httpx.HTTPError:
            return {}
        return parse_metrics(resp.text) if resp.status_code == 200 else {}

    async def get_json(self, path: str) -> Any:
        """GET `path` from the server's root; None on any failure (the caller treats it as unknown)."""
        try:
            resp = await self._http.get(self.root_url + path)
            return resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    @property
    def root_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    def api_url(self, path: str) -> str:
        root = self.base_url if self.base_url.endswith("/v1") else self.base_url + "/v1"
        return root + path

    async def chat(self, body: dict[str, Any], sample: Sample, on_sent: Callable[[], None] | None = None,
                   on_chunk: Callable[[dict[str, Any]], None] | None = None,
                   on_first_token: Callable[[], Awaitable[None]] | None = None) -> Sample:
        """Send one streaming request; fill in `sample`'s timings and usage. Raises ContextTooLong.
        `on_chunk` sees every parsed chunk (to assemble the message, as an SDK does);
        `on_first_token` is awaited once the first token is timed, the stream held open meanwhile.

        The clock starts when the request's first byte goes to the socket (httpcore's trace), so
        the client library's own work before that (~3-5 ms for httpx on a slow CPU) is reported
        apart, as `client_prep_s`, and not charged to the server. `on_sent` is called once the
        whole request is on the wire (or once it failed before that)."""
        started = time.perf_counter()
        sample.started_s = started - self.clock_zero
        headers = BYPASS_HEADERS if sample.bypass else None
        wire = [started]
        sent = [False]

        def mark_sent() -> None:
            if on_sent is not None and not sent[0]:
                sent[0] = True
                on_sent()

        async def trace(event: str, info: dict[str, Any]) -> None:
            if event == "http11.send_request_headers.started":
                wire[0] = time.perf_counter()
            elif event == "http11.send_request_body.complete":
                mark_sent()

        try:
            async with self._http.stream("POST", self.api_url("/chat/completions"), json=body,
                                         headers=headers, extensions={"trace": trace}) as resp:
                if resp.status_code != 200:
                    _raise_for_body(resp.status_code, (await resp.aread()).decode(errors="replace"))
                sample.server_timing_ms = parse_server_timing(resp.headers.get("server-timing"))
                await self._read_stream(resp, sample, wire[0], on_chunk, on_first_token)
        except httpx.HTTPError as exc:
            sample.error = f"{type(exc).__name__}: {exc}"
        except _ServerError as exc:
            sample.error = str(exc)
        finally:
            mark_sent()
        sample.client_prep_s = wire[0] - started
        sample.total_s = time.perf_counter() - wire[0]
        return sample

    async def complete(self, body: dict[str, Any], sample: Sample) -> dict[str, Any] | None:
        """Send one request without streaming; fill in `sample`'s total time and usage and return
        the response (None on an error, which `sample.error` says). Raises ContextTooLong."""
        started = time.perf_counter()
        sample.started_s = started - self.clock_zero
        headers = BYPASS_HEADERS if sample.bypass else None
        try:
            resp = await self._http.post(self.api_url("/chat/completions"), json=body, headers=headers)
            if resp.status_code != 200:
                _raise_for_body(resp.status_code, resp.text)
            response: dict[str, Any] = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            sample.error = f"{type(exc).__name__}: {exc}"
            return None
        except _ServerError as exc:
            sample.error = str(exc)
            return None
        finally:
            sample.total_s = time.perf_counter() - started
        sample.server_timing_ms = parse_server_timing(resp.headers.get("server-timing"))
        if response.get("usage"):
            _take_usage(sample, response["usage"])
        return response

    async def _read_stream(self, resp: httpx.Response, sample: Sample, started: float,
                           on_chunk: Callable[[dict[str, Any]], None] | None = None,
                           on_first_token: Callable[[], Awaitable[None]] | None = None) -> None:
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if sample.first_chunk_s is None:
                sample.first_chunk_s = time.perf_counter() - started
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise _ServerError(f"error in stream: {chunk['error'].get('message')}")
            if on_chunk is not None:
                on_chunk(chunk)
            if _has_token(chunk):
                sample.token_chunks += 1
                sample.tool_calls += _calls_opened(chunk)
                if sample.ttft_s is None:
                    sample.ttft_s = time.perf_counter() - started
                    if on_first_token is not None:
                        await on_first_token()
            if chunk.get("usage"):
                _take_usage(sample, chunk["usage"])


class _ServerError(Exception):
    pass


def _raise_for_body(status: int, text: str) -> None:
    try:
        error = json.loads(text).get("error") or {}
    except ValueError:
        error = {}
    message = error.get("message") if isinstance(error, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    if code == "context_length_exceeded" or (status == 400 and "context" in (message or text).lower()):
        raise ContextTooLong(message or text)
    raise _ServerError(f"HTTP {status}: {(message or text)[:300]}")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {series: value}; comments and unparsable lines are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series and not line.startswith("#"):
            try:
                out[series] = float(value)
            except ValueError:
                pass
    return out


def parse_server_timing(header: str | None) -> dict[str, float] | None:
    """`name;dur=1.5, other;desc="x";dur=2` -> {name: 1.5, other: 2.0}; None without durations."""
    out: dict[str, float] = {}
    for metric in (header or "").split(","):
        name, *params = (p.strip() for p in metric.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "dur" and name:
                try:
                    out[name] = float(value.strip('"'))
                except ValueError:
                    pass
    return out or None


def _has_token(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls"):
            return True
    return False


def _calls_opened(chunk: dict[str, Any]) -> int:
    deltas = [choice.get("delta") or {} for choice in chunk.get("choices") or ()]
    return sum(1 for delta in deltas for call in delta.get("tool_calls") or () if call.get("id"))


def _take_usage(sample: Sample, usage: dict[str, Any]) -> None:
    sample.prompt_tokens = usage.get("prompt_tokens")
    sample.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    sample.cached_tokens = int(cached) if cached is not None else None
