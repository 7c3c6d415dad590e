"""The engine: the one owner of the model and the prefix store. A worker thread takes jobs from a
bounded queue, so the event loop never blocks on torch.

Per job: look the prefix up (RAM, then compute); a miss computes the prefix KV once, stores it,
and then runs exactly the hit path, so a hit and a miss produce bitwise-identical output. A
bypass runs a plain full prefill. A cached prefix whose logits come out NaN or infinite (a
poisoned file passes its checksum when its writer had write access) is dropped and the request
recomputed with a plain prefill; only a model that gives non-finite logits by itself fails.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from gateway.engine.stats import EngineStats, StepLog, StepRecord
from gateway.kvcache.entry import CacheEntry, LayerKV, spare_room
from gateway.kvcache.growing import GrowingLayer
from gateway.kvcache.keys import CacheIdentity, PrefixKey
from gateway.kvcache.store import PrefixStore
from gateway.sampling import NonFiniteLogits, Sampler, SamplingParams, TextStream, all_finite

log = logging.getLogger(__name__)

CacheResult = Literal["hit", "miss", "bypass", "skip"]
FIRST_TOKEN_HANDOFF_S = 0.05


@dataclass(frozen=True, slots=True)
class Prefilled:
    prompt_tokens: int
    cached_tokens: int
    result: CacheResult
    tier: str | None
    restore_s: float
    compile_s: float
    prefill_s: float  # all of the above: lookup, compile (a miss), restore and the forward pass
    forward_s: float = 0.0  # the model's own forward over the uncached tokens
    queued_s: float = 0.0  # from submit until the engine took the job
    lookup_s: float = 0.0  # key hash + cache lookup


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: Literal["stop", "length"]
    completion_tokens: int
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Failed:
    message: str


EngineEvent = Prefilled | TextDelta | Finished | Failed


@dataclass(slots=True)
class Job:
    prompt_ids: list[int]
    prefix_len: int  # tokens of the tool group; 0 when there is none
    params: SamplingParams
    emit: Callable[[EngineEvent], None]  # must be thread-safe
    use_cache: bool = True
    salt: str = ""
    group_id: str = ""
    tool_names: tuple[str, ...] = ()
    keep_token_ids: frozenset[int] = frozenset()  # special tokens the output text must keep
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = 0.0  # perf_counter at submit
    # Set by a streaming consumer once the first token is on the wire; the engine waits for it
    # (at most FIRST_TOKEN_HANDOFF_S) before the next forward, so the event loop has the CPU and
    # the GIL while it sends the first token. None: nobody waits on the first token.
    first_token_sent: threading.Event | None = None


class QueueFull(Exception):
    pass


@dataclass(slots=True)
class Task:
    """Work other than a generation that must run on the engine thread (e.g. warming a prefix)."""

    fn: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)


class Engine:
    def __init__(self, model: Any, tokenizer: Any, store: PrefixStore, identity: CacheIdentity,
                 *, min_prefix_tokens: int, max_queue: int, device: torch.device) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.store = store
        self.identity = identity
        self.min_prefix_tokens = min_prefix_tokens
        self.device = device
        self.eos_ids = _eos_ids(model, tokenizer)
        self.special_ids = _special_ids(tokenizer)
        self._jobs: queue.Queue[Job | Task | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="toolkv-engine", daemon=True)
        self.busy = False
        self.num_cancelled = 0  # generations stopped because their client went away
        self._steps = StepLog()
        self._num_steps = 0

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)
        self.store.close()  # finish pending disk writes, so a restart finds them

    def submit(self, job: Job) -> None:
        job.submitted = time.perf_counter()
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` on the engine thread, between generations; its result arrives in the future."""
        task = Task(fn)
        try:
            self._jobs.put_nowait(task)
        except queue.Full:
            raise QueueFull from None
        return task.future

    @property
    def queue_depth(self) -> int:
        return self._jobs.qsize()

    def stats(self) -> EngineStats:
        return EngineStats(running=int(self.busy), waiting=self._jobs.qsize(), kv_blocks_total=0,
                           kv_blocks_used=0, kv_blocks_cached=0, kv_block_tokens=0, preemptions_total=0,
                           prefix_queries_tokens_total=0, prefix_hits_tokens_total=0,
                           steps_total=self._num_steps, cancelled_total=self.num_cancelled)

    def drain_steps(self) -> list[StepRecord]:
        return self._steps.drain()

    def key_for(self, prefix_ids: list[int], salt: str = "") -> PrefixKey:
        identity = self.identity if not salt else CacheIdentity(
            self.identity.model_fingerprint, self.identity.tokenizer_fingerprint,
            self.identity.adapter_version, salt)
        return PrefixKey.of(identity, prefix_ids)

    # ---- worker ----------------------------------------------------------------------------

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if isinstance(job, Task):
                self._run_task(job)
                continue
            if job.cancelled.is_set():
                continue
            self.busy = True
            try:
                with torch.inference_mode():
                    self._generate(job)
            except Exception as exc:  # one request fails, never the engine
                log.exception("generation failed")
                # The client sees no exception text: it may hold a path or other server detail.
                job.emit(Failed(f"generation failed ({type(exc).__name__}); the server log has the details"))
            finally:
                self.busy = False

    def _run_task(self, task: Task) -> None:
        if not task.future.set_running_or_notify_cancel():
            return
        try:
            with torch.inference_mode():
                task.future.set_result(task.fn())
        except Exception as exc:
            task.future.set_exception(exc)

    def _generate(self, job: Job) -> None:
        logits, cache, prefilled = self._prefill(job)
        job.emit(prefilled)
        self._decode(job, logits, cache)

    def _prefill(self, job: Job) -> tuple[torch.Tensor, Any, Prefilled]:
        started = time.perf_counter()
        queued_s = started - job.submitted if job.submitted else 0.0
        if not job.use_cache:
            return self._plain_prefill(job, "bypass", started, queued_s)
        if job.prefix_len < self.min_prefix_tokens or job.prefix_len >= len(job.prompt_ids):
            return self._plain_prefill(job, "skip", started, queued_s)
        key = self.key_for(job.prompt_ids[: job.prefix_len], job.salt)
        found = self.store.lookup(key)
        lookup_s = time.perf_counter() - started
        compile_s, result, tier = 0.0, "hit", None
        if found is None:
            entry = self.compile_prefix(key, job.group_id, job.tool_names)
            compile_s, result = entry.compile_s, "miss"
        else:
            entry, tier = found.entry, found.tier
            entry.touch()
        self.store.lock(entry)
        try:
            restore_started = time.perf_counter()
            cache = self.restore(entry, room_tokens=job.params.max_tokens + 1)
            forward_started = time.perf_counter()
            restore_s = forward_started - restore_started
            logits = self.forward(job.prompt_ids[job.prefix_len :], cache)
            forward_s = time.perf_counter() - forward_started
        finally:
            self.store.unlock(entry)
        if not all_finite(logits):
            self.store.quarantine(entry, "nonfinite", "its KV gave non-finite logits")
            return self._plain_prefill(job, "miss", started, queued_s)
        cached = job.prefix_len if result == "hit" else 0  # a miss computed its prefix just now
        prefilled = Prefilled(len(job.prompt_ids), cached, result, tier,  # type: ignore[arg-type]
                              restore_s, compile_s, time.perf_counter() - started, forward_s, queued_s, lookup_s)
        return logits, cache, prefilled

    def _plain_prefill(self, job: Job, result: CacheResult, started: float,
                       queued_s: float) -> tuple[torch.Tensor, Any, Prefilled]:
        cache = self.new_cache(room_tokens=job.params.max_tokens + 1)
        forward_started = time.perf_counter()
        logits = self.forward(job.prompt_ids, cache)
        if not all_finite(logits):
            raise NonFiniteLogits("the model gave non-finite logits on a plain prefill")
        done = time.perf_counter()
        return logits, cache, Prefilled(len(job.prompt_ids), 0, result, None, 0.0, 0.0,
                                        done - started, done - forward_started, queued_s)

    def compile_prefix(self, key: PrefixKey, group_id: str, tool_names: tuple[str, ...]) -> CacheEntry:
        """Compute the prefix KV once and store it (callable from the worker thread only)."""
        started = time.perf_counter()
        log.info("compiling tool group %s: %d prefix tokens", group_id or "-", len(key.token_ids))
        cache = self.new_cache(room_tokens=spare_room(len(key.token_ids)))
        self.forward(list(key.token_ids), cache)
        layers = tuple(
            LayerKV(layer.keys, layer.values, getattr(layer, "cumulative_length", None),
                    *(layer.room() if isinstance(layer, GrowingLayer) else (None, None)))
            for layer in cache.layers
        )
        entry = CacheEntry(key=key, layers=layers, group_id=group_id, tool_names=tool_names,
                           compile_s=time.perf_counter() - started)
        self.store.insert(entry)
        log.info("compiled tool group %s in %.2fs (%.1f MB of KV)", group_id or "-", entry.compile_s,
                 entry.num_bytes / 1e6)
        return entry

    def new_cache(self, room_tokens: int | None = None) -> Any:
        """A fresh cache; with `room_tokens`, full-attention layers grow in place while decoding."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=self.model.config)
        if room_tokens is not None:
            cache.layers = [GrowingLayer(room_tokens) if type(layer) is DynamicLayer else layer
                            for layer in cache.layers]
        return cache

    def restore(self, entry: CacheEntry, room_tokens: int | None = None) -> Any:
        """A cache holding the entry's tensors by reference: no copy. With `room_tokens`, a request
        appends into the entry's spare room (one request at a time: this thread is the only one);
        otherwise the first update writes into new tensors. The prefix's own positions are never
        written either way."""
        cache = self.new_cache(room_tokens)
        for layer, stored in zip(cache.layers, entry.layers, strict=True):
            if isinstance(layer, GrowingLayer) and stored.key_room is not None and stored.value_room is not None:
                layer.adopt(stored.keys, stored.values, stored.key_room, stored.value_room)
                continue
            layer.lazy_initialization(stored.keys, stored.values)
            layer.keys, layer.values = stored.keys, stored.values
            if stored.cumulative_length is not None:
                layer.cumulative_length = stored.cumulative_length
        return cache

    def forward(self, token_ids: list[int], cache: Any) -> torch.Tensor:
        """The model over `token_ids` after what `cache` holds (which it extends); the last
        position's logits. Engine thread only (the bench's floor probe calls it on its own engine)."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits: torch.Tensor = out.logits[0, -1]
        return logits

    def _decode(self, job: Job, logits: torch.Tensor, cache: Any) -> None:
        sampler = Sampler(job.params)
        stream = TextStream(self.tokenizer, job.params.stop, self.special_ids, job.keep_token_ids)
        for count in range(1, job.params.max_tokens + 1):
            if job.cancelled.is_set():
                self.num_cancelled += 1
                return
            token = sampler.next_token(logits)
            if token in self.eos_ids:
                self._finish(job, stream, "stop", count - 1)
                return
            delta = stream.push(token)
            if delta:
                job.emit(TextDelta(delta))
                if job.first_token_sent is not None and not job.first_token_sent.is_set():
                    job.first_token_sent.wait(FIRST_TOKEN_HANDOFF_S)
            if stream.stopped:
                job.emit(Finished("stop", count, tuple(stream.token_ids)))
                return
            if count < job.params.max_tokens:
                logits = self.forward([token], cache)
        self._finish(job, stream, "length", job.params.max_tokens)

    def _finish(self, job: Job, stream: TextStream, reason: Literal["stop", "length"], count: int) -> None:
        rest = stream.flush()
        if rest:
            job.emit(TextDelta(rest))
        job.emit(Finished(reason, count, tuple(stream.token_ids)))


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    vocab = tokenizer.get_vocab()
    for token in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<|eom_id|>"):
        if token in vocab:
            ids.add(vocab[token])
    return frozenset(ids)


def _special_ids(tokenizer: Any) -> frozenset[int]:
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(int(i) for i, token in decoder.items() if getattr(token, "special", False))
    return frozenset(ids)
