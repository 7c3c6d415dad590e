"""Everything that exists once the model is loaded: engine, prefix store, chat service."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio

from adapters.families import ADAPTER_VERSION, detect_family, get_family
from adapters.render import PromptRenderer
from adapters.toolcalls.vllm_names import adapter_for
from gateway.engine import Engine, QueueFull
from gateway.engine.cpu_threads import ThreadGovernor, usable_cpus
from gateway.engine.model_info import ModelInfo
from gateway.engine.model_loader import LoadedModel, load_model
from gateway.engine.plan import engine_plan
from gateway.engine.stats import Snapshot, take_snapshot
from gateway.kvcache.block_pool import RamTier
from gateway.kvcache.disk_tier import DiskTier
from gateway.kvcache.entry import CacheIdentity
from gateway.kvcache.store import PrefixStore
from gateway.metrics import Metrics
from gateway.serving.cache_admin import read_configured_groups, warm_configured
from gateway.serving.kv_pool_size import kv_pool_size
from gateway.serving.prompt_tokens import turn_opening
from gateway.serving.service import ChatService
from gateway.serving.store_admin import StoreAdmin
from gateway.settings import Settings, format_size

log = logging.getLogger(__name__)

_SNAPSHOT_WAIT_S = 10.0  # a step, however slow, ends well within this


@dataclass(slots=True)
class Runtime:
    loaded: LoadedModel
    engine: Engine
    service: ChatService
    store: PrefixStore
    metrics: Metrics
    _refreshing: bool = False  # a gauge refresh is running on a worker thread
    _snapshot: Snapshot | None = None  # the last one the engine took
    model_name: str = field(init=False)  # the served name (/v1/models)
    model_aliases: frozenset[str] = field(init=False)  # what a request's `model` may say: name or location

    def __post_init__(self) -> None:  # once at load: every request reads them
        self.model_name = self.loaded.source.served_name
        self.model_aliases = frozenset({self.loaded.source.served_name, self.loaded.source.location})

    @property
    def admin(self) -> StoreAdmin:
        """The store as routes change it: through the engine's thread (serving/store_admin.py)."""
        return StoreAdmin(self.engine, self.store)

    async def snapshot(self) -> Snapshot | None:
        """A snapshot of the engine and its store, taken on the engine's thread between steps;
        the last one when the engine's queue is full or it does not answer in time."""
        take = partial(take_snapshot, self.engine, self.store)
        if not self.store.owner.held_elsewhere():  # not started, or stopped: nothing changes it
            self._snapshot = take()
            return self._snapshot
        try:
            future = self.engine.call(take)
            self._snapshot = await asyncio.wait_for(asyncio.wrap_future(future), _SNAPSHOT_WAIT_S)
        except (QueueFull, TimeoutError):
            pass
        return self._snapshot

    def engine_info(self) -> dict[str, Any]:
        """What the engine runs on, for `/version` (a bench or an operator reads it from there)."""
        runner = self.engine.runner
        return {"device": str(self.loaded.device), "dtype": str(self.loaded.dtype).removeprefix("torch."),
                "quantization": self.loaded.quantization,  # "none", "nf4" or "int8" (bitsandbytes)
                "backend": runner.backend, "batch_invariant": runner.batch_invariant,
                "fused_layers": runner.model.kind == "owned", "cuda_graphs": runner.graphs is not None,
                "model_impl": runner.model.kind,  # "owned", or "transformers" (the eager fallback)
                "cuda_graph_max_tokens": max(runner.graphs.flat_sizes, default=0) if runner.graphs is not None else 0,
                "cuda_graphs_captured": runner.graphs.num_captured if runner.graphs is not None else 0,
                "cuda_graphs_eager": (runner.graphs.num_graphs - runner.graphs.num_captured
                                      if runner.graphs is not None else 0),
                "decode_overlap": self.engine.overlap}

    async def refresh_gauges_off_loop(self) -> None:
        """`refresh_gauges` on a worker thread: listing a cache dir of many thousand files takes
        a good part of a second, and /metrics needs no key. A scrape that comes while one refresh
        runs serves the values the last one left, so a flood of scrapes holds one thread at most."""
        if self._refreshing:
            return
        self._refreshing = True
        try:
            snapshot = await self.snapshot()
            if snapshot is not None:
                await anyio.to_thread.run_sync(self.refresh_gauges, snapshot)
        finally:
            self._refreshing = False

    def refresh_gauges(self, snapshot: Snapshot) -> None:
        """The gauges from `snapshot` (the engine's) and from the disk tier and pins (their own)."""
        m = self.metrics
        m.cache_entries.labels(tier="ram").set(snapshot.store.ram_entries)
        m.cache_bytes.labels(tier="ram").set(snapshot.store.ram_bytes)
        m.cache_pinned_bytes.set(self.store.pinned_bytes())
        m.grammar_cache_bytes.set(self.service.grammars.num_bytes)
        m.tokenizer_heads_bytes.set(self.service.prompt_tokens.num_bytes)
        m.memory_budget_bytes.labels(structure="grammar_cache").set(self.service.grammars.max_bytes)
        m.memory_budget_bytes.labels(structure="tokenizer_heads").set(self.service.prompt_tokens.max_bytes)
        if self.store.disk is not None:
            num_files, num_bytes = self.store.disk.usage()
            m.cache_entries.labels(tier="disk").set(num_files)
            m.cache_bytes.labels(tier="disk").set(num_bytes)
        m.observe_engine(snapshot.engine, self.engine.drain_steps(), self.model_name)  # and queue depth
        for (event, label), count in self.store.tally.drain().items():
            counter = m.evictions.labels(tier=label) if event == "eviction" else m.cache_errors.labels(kind=label)
            counter.inc(count)


def build_runtime(settings: Settings, metrics: Metrics, loaded: LoadedModel | None = None) -> Runtime:
    """The model loaded and its engine running, with the groups `pinned_groups` and `warm_groups`
    name warmed (their files are read first: a wrong path fails before the model loads)."""
    configured = read_configured_groups(settings)
    if loaded is None:
        log.info("loading model %s (device %s, dtype %s)...", settings.model, settings.device, settings.dtype)
        loaded = load_model(settings)
    tokenizer = loaded.tokenizer
    adapter = adapter_for(settings.adapter, settings.tool_call_parser)  # vLLM's --tool-call-parser folded in
    family = (get_family(adapter) if adapter != "auto" else
              detect_family(loaded.model.config.model_type, tokenizer.chat_template))
    plan = engine_plan(settings, loaded.device, loaded.model)
    # The chunk size and the kernels decide a group's KV bits (see gateway/engine/model_runner.py).
    identity = CacheIdentity(loaded.fingerprint, loaded.tokenizer_fingerprint,
                             f"{family.name}-{ADAPTER_VERSION}-chunk{plan.chunk_tokens}-{plan.kernels}")
    info = ModelInfo.of(loaded.model, tokenizer, identity)
    context_len = min(loaded.context_len, settings.max_model_len or loaded.context_len)  # --max-model-len caps it
    pool = kv_pool_size(settings, loaded.device, info.pool_shape.bytes_per_token if info.pool_shape else 0, context_len)
    log.info("%s", pool.described)  # "the KV pool (1440 MiB: 4 sequences of 8,192 tokens, ...)"
    store = PrefixStore(RamTier(pool.num_bytes), _disk_tier(settings, identity, loaded),
                        retained_budget_bytes=settings.retained_budget_bytes)
    block_bytes = info.pool_shape.bytes_per_token * settings.kv_block_tokens if info.pool_shape else 0
    if pool.num_bytes < block_bytes:  # a pool of no block: /health ok, every request refused
        raise ValueError(f"{pool.described} holds no KV block: one "
                         f"block of {settings.kv_block_tokens} tokens of this model takes {format_size(block_bytes)}")
    # Prompt chunks are cut where the template's assistant turns open (engine/prefix_index.py).
    opening = turn_opening(tokenizer, PromptRenderer(tokenizer, family).template)
    plan = dataclasses.replace(plan, pool_bytes=pool.num_bytes, turn_opening=opening)
    engine = Engine(loaded.model, tokenizer, info, store, plan, threads=_thread_governor(settings, loaded))
    service = ChatService(engine, info, tokenizer, family, loaded.source.served_name, context_len, metrics,
                          cache_enabled=settings.cache_enabled, default_max_tokens=settings.default_max_tokens,
                          max_string_chars=settings.max_string_chars,
                          reserve_tokens=settings.constrained_reserve_tokens,
                          grammar_cache_bytes=settings.grammar_cache_bytes,
                          tokenizer_heads_bytes=settings.tokenizer_heads_bytes)
    service.warm_up()
    if engine.threads is not None:  # the engine's warm-up runs on this thread: its count too
        engine.threads.adjust()
    engine.start()
    try:
        warm_configured(service, StoreAdmin(engine, store), configured, settings)
    except BaseException:
        engine.stop()
        raise
    log.info("model %s ready in %.1fs on %s (%s), adapter %s", loaded.source.served_name, loaded.load_s,
             loaded.device, loaded.dtype, family.name)
    return Runtime(loaded, engine, service, store, metrics)


def _thread_governor(settings: Settings, loaded: LoadedModel) -> ThreadGovernor | None:
    """On the CPU with `adaptive_threads` (the default), torch's threads follow the cores other work
    leaves (engine/cpu_threads.py), unless `num_threads` fixes them. The engine adapts them only on
    its own model, whose products and attention it runs at shapes that round alike on any count."""
    if loaded.device.type != "cpu" or settings.num_threads is not None or not settings.adaptive_threads:
        return None
    return ThreadGovernor(usable_cpus())


def _disk_tier(settings: Settings, identity: CacheIdentity, loaded: LoadedModel) -> DiskTier | None:
    if settings.disk_budget_bytes == 0:
        return None
    disk = DiskTier(settings.resolved_cache_dir, settings.disk_budget_bytes, identity, loaded.device,
                    retained_budget_bytes=settings.retained_budget_bytes)
    disk.sweep_stale_temps()
    evicted = disk.evict_over_budget()  # a dir left over budget (a lower budget now) shrinks at start
    if evicted:
        log.info("the cache dir was over disk_budget_bytes: removed %d least recently used entries", len(evicted))
    return disk
