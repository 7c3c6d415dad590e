"""The engine: the one owner of the model, the KV block pool and the prefix store. Requests are
served by continuous batching on one worker thread, so the event loop never blocks on torch.

The loop (`_run`) takes new work between steps (jobs wait in a bounded inbox, 429 past
`max_queue`, events.py `Intake`; tasks run on this thread as they come), then runs `step`, which reads as
the design: schedule -> forward -> update.
1. schedule (scheduler.py, the one owner of the batch): drop sequences whose client went away
   (their blocks free at once); admit waiting jobs while fewer than `max_batch` sequences run, in
   turn between tenants, pausing a sequence of a tenant above its share of the batch for one below
   it: the cache manager looks the tool group up (RAM, disk) and reserves blocks for the rest
   (evicting unused cached groups if the pool is full; a job that does not fit yet waits, one that
   never can is refused at submit); then choose the step: the decoding sequences' next tokens and
   the prompt chunks within the step's token budget, a fair share for each tenant (scheduler.py `StepPlanner`);
2. forward: one pass over the step's flat batch (model_runner.py); while the device computes, the
   CPU computes the grammar masks; every row to sample is chosen on the device at once;
3. update (outputs.py): what a step's output does to each sequence: store a computed group, take
   tokens, emit text, retire sequences that are done.
A step of every running sequence's decode row, one token each, may instead start a run of decode
steps each launched before the last one is read (`decode_overlap`, decode_ahead.py).

A hit reads the stored group's blocks in place; a miss computes them (in chunks, between other
sequences' steps) and stores them, starting from the longest prefix it shares with a cached group
(a tool list that differs from a cached one at its end); a bypass computes them privately. After
the group, a request starts from the longest prefix of an earlier request's prompt in its tenant's
conversation records (prefix_index.py), copied into its own blocks, and computes only the rest;
when it ends, its prompt's KV is kept as a record for its conversation's next turn. All three run the same
operations on the same numbers, so their output is identical (model_runner.py says why). A cached
group whose logits come out NaN or infinite (a poisoned file passes its checksum when its writer
had write access) is dropped and the request recomputed; only a model that gives non-finite
logits by itself fails (outputs.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from gateway.engine import models
from gateway.engine.cache_manager import KVCacheManager, Placement
from gateway.engine.cpu_threads import ThreadGovernor, invariant_rows
from gateway.engine.decode_ahead import DecodeAhead
from gateway.engine.events import CutOff, Intake, Job, JobStream, Task, TooLarge, WarmGroup
from gateway.engine.model_info import ModelInfo
from gateway.engine.model_runner import ModelRunner, staged, tensor_bytes
from gateway.engine.outputs import OutputProcessor, StepOutput
from gateway.engine.plan import EnginePlan
from gateway.engine.sampling import device_picks
from gateway.engine.scheduler import Scheduler, StepPlan
from gateway.engine.sequence import Phase, Sequence
from gateway.engine.stats import DeviceSpan, EngineStats, StepCounts, StepRecord
from gateway.engine.tokenizer import Tokenizer
from gateway.engine.warmup import warm_up
from gateway.kvcache.block_pool import BlockPool
from gateway.kvcache.entry import CacheEntry, PrefixKey
from gateway.kvcache.store import PrefixStore

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: Any, tokenizer: Tokenizer, info: ModelInfo, store: PrefixStore,
                 plan: EnginePlan, threads: ThreadGovernor | None = None) -> None:
        assert info.identity is not None and info.pool_shape is not None, "the engine needs a loaded model's info"
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        self.store = store
        self.plan = plan
        self.device = device = plan.device
        self.max_batch = plan.max_batch
        # Before the pool: toolkv's own model (or transformers' eager fallback, torch attention only).
        step_model = models.build(model, plan.backend, owned=plan.fused)
        backend = plan.backend if step_model.kind == "owned" else "torch"
        self.pool = BlockPool(info.pool_shape, plan.pool_bytes, plan.block_tokens, device)
        self.runner = ModelRunner(step_model, device, self.pool, backend=backend,
                                  batch_invariant=plan.batch_invariant, weights_bytes=tensor_bytes(model))
        # CUDA graphs, of chunk steps up to this many tokens (None: none; engine/cuda_graphs.py)
        self.graph_tokens = plan.graph_tokens if backend == "triton" else None
        self.overlap = plan.overlap  # decode steps launched one ahead (decode_ahead.py)
        # torch's CPU threads, fewer while other work holds the cores (cpu_threads.py): only where toolkv
        # runs the products itself, padded to row counts that round alike on any thread count.
        products = step_model.matrices(head=not plan.batch_invariant)
        self.threads = threads if products is not None else None
        if self.threads is not None and products is not None:
            self.runner.thread_rows = invariant_rows(products, self.threads.max_threads)
        self.cache = KVCacheManager(store, self.pool, info.identity, chunk_tokens=plan.chunk_tokens,
                                    min_prefix_tokens=plan.min_prefix_tokens, turn_opening=plan.turn_opening,
                                    conversation_reuse=plan.conversation_reuse, pool_only=self.runner.reads_pool_only)
        self.scheduler = Scheduler(self.cache, self._new_sequence, max_batch=plan.max_batch,
                                   chunk_tokens=plan.chunk_tokens, batch_invariant=plan.batch_invariant)
        self._intake = Intake(plan.max_queue, held=lambda: self.scheduler.num_waiting)
        self._outputs = OutputProcessor(self.scheduler, info.eos_ids)
        self._counts = StepCounts()
        self.ahead = DecodeAhead(self.runner, self.scheduler, self._outputs, self._intake, self._counts)
        self._thread = threading.Thread(target=self._run, name="toolkv-engine", daemon=True)
        for owned in (store.owner, self.pool.owner):  # changed on this thread only, once it runs (block_pool.Owner)
            owned.bind(self._thread, self.call)

    # ---- public API ------------------------------------------------------------------------

    def start(self) -> None:
        """Warm up, then serve: the runtime (and so `/health`) is ready only after this."""
        warm_up(self.runner, self.scheduler.chunk_tokens, self.max_batch, self.graph_tokens)
        if self.overlap and self.device.type == "cuda" and self.runner.graphs is None:
            # An eager step's launches take longer than the device's work (~35 ms of host time for
            # an 8B model): launching one ahead hides nothing, and a row's step past its end is paid.
            log.info("decode steps are not launched ahead: no CUDA graphs")
            self.overlap = False
        self._thread.start()

    def stop(self) -> None:
        self._intake.close()
        self._thread.join(timeout=30)
        self.store.close()  # finish pending disk writes, so a restart finds them

    def submit(self, job: Job) -> JobStream:
        """Queue a generation; returns its events (read on the calling event loop; closing the
        stream stops the job). Raises QueueFull when too many wait, TooLarge when the pool could
        never hold it."""
        if self.cache.blocks_needed(job) > self.pool.num_blocks:
            raise TooLarge(f"the request needs {len(job.prompt_ids) + job.params.max_tokens} tokens of KV; "
                           f"the KV pool holds {self.pool.num_blocks * self.pool.block_tokens}")
        stream = JobStream(job, self.abort, forward=job.emit)
        job.emit = stream.put
        job.submitted = time.perf_counter()
        self._intake.put(job)
        return stream

    def cut_off(self, reason: str) -> Future[Any]:
        """End every running generation with `CutOff(reason)` (the shutdown grace period ran out),
        between steps: each client gets its API's error (an error event, then the end of its stream)
        before the server cancels what is left."""
        def cut() -> None:
            self.scheduler.resume_all()  # a paused generation is running too
            for seq in list(self.scheduler.running):
                self._outputs.fail(seq, CutOff(reason))
        return self.call(cut)

    def abort(self, job: Job) -> None:
        """Stop a job wherever it is (queued, waiting or running); its blocks are freed."""
        job.cancelled.set()

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` on the engine thread, between steps; its result arrives in the future."""
        task = Task(fn)
        self._intake.put(task)
        return task.future

    def warm(self, key: PrefixKey, group_id: str, tool_names: tuple[str, ...]) -> Future[tuple[CacheEntry, bool]]:
        """Make sure the group `key` (in the shared namespace) is cached: found in RAM or on disk,
        or computed like a request's group, in chunks between other requests' steps. The future
        gives the entry and whether it was cached already. Raises QueueFull, and TooLarge when the
        pool could never hold it."""
        if self.pool.blocks_for(len(key.token_ids)) + 1 > self.pool.num_blocks:
            raise TooLarge(f"the group is {len(key.token_ids)} tokens of KV; "
                           f"the KV pool holds {self.pool.num_blocks * self.pool.block_tokens}")
        warm = WarmGroup(key, group_id, tool_names)
        warm.job.submitted = time.perf_counter()
        self._intake.put(warm)
        return warm.future

    def forget_conversations(self) -> Future[int]:
        """Drop every conversation record (on the engine thread, between steps); the future gives
        how many there were. Raises QueueFull."""
        return self.call(self.cache.conversations.clear)

    def stats(self) -> EngineStats:
        cache = self.cache
        conversations = cache.conversations
        return EngineStats(running=len(self.scheduler.running), waiting=self._intake.depth,
                           kv_blocks_total=self.pool.num_blocks, kv_blocks_used=self.pool.num_used,
                           kv_blocks_cached=cache.cached_blocks(), kv_block_tokens=self.pool.block_tokens,
                           preemptions_total=self.scheduler.num_paused,
                           prefix_queries_tokens_total=cache.query_tokens,
                           prefix_hits_tokens_total=cache.hit_tokens, steps_total=self.num_steps,
                           cancelled_total=self.num_cancelled, conversation_records=len(conversations),
                           conversation_blocks=conversations.num_blocks,
                           conversation_hits_tokens_total=cache.conversation_hit_tokens,
                           conversation_evictions_total=conversations.evictions,
                           constrained_tokens_total=self.constrained_tokens,
                           constraint_seconds_total=self.constraint_s, forced_tokens_total=self.forced_tokens,
                           decode_steps_total=self.decode_steps, decode_seconds_total=self.decode_s,
                           memory=self.runner.memory())

    def drain_steps(self) -> list[StepRecord]:
        return self._counts.log.drain()

    @property
    def queue_depth(self) -> int:
        return self._intake.depth

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.running)

    @property
    def num_steps(self) -> int:
        return self._counts.steps

    @property
    def decode_steps(self) -> int:
        return self._counts.decode_steps

    @property
    def decode_s(self) -> float:
        return self._counts.decode_s

    @property
    def num_cancelled(self) -> int:
        """Sequences stopped because their client went away."""
        return self.scheduler.num_cancelled

    @property
    def ahead_steps(self) -> int:
        """Decode steps launched before the one before them was read."""
        return self.ahead.ahead_steps

    @property
    def constrained_tokens(self) -> int:
        """Tokens sampled under a grammar."""
        return self._outputs.constrained_tokens

    @property
    def forced_tokens(self) -> int:
        """Tokens a grammar forced (taken without a choice)."""
        return self._outputs.forced_tokens

    @property
    def chunk_forced(self) -> bool:
        """Whether forced tokens go to the model as one chunk (True, the default) or a step each."""
        return self._outputs.chunk_forced

    @chunk_forced.setter
    def chunk_forced(self, on: bool) -> None:
        self._outputs.chunk_forced = on

    @property
    def constraint_s(self) -> float:
        """Time the grammars took (masks and following) for those tokens."""
        return self._outputs.constraint_s

    # ---- the step loop -----------------------------------------------------------------------

    def step(self) -> None:
        """One step: schedule -> forward -> update (module doc)."""
        plan = self.scheduler.schedule()
        self._outputs.refuse(plan.refused)
        if not plan:
            return
        if self.threads is not None:
            self.threads.adjust()
        if self.overlap and self.ahead.starts(plan):
            self.ahead.run(plan.decode)
            return
        started, span = time.perf_counter(), DeviceSpan(self.device)  # on CUDA the device's time (the step log)
        output = self._forward(plan)
        if output is not None:
            self._outputs.update(output)
            decode_s = time.perf_counter() - started if plan.decode else None
            self._counts.add(len(output.decode) + len(output.prefill), output.num_tokens, decode_s, span.end())

    def _run(self) -> None:
        while True:
            for item in self._intake.take(self.scheduler.idle, self.scheduler.holding):
                if isinstance(item, Task):
                    self._run_task(item)
                else:
                    self.scheduler.add(item)
            if self._intake.closed:
                break
            try:
                self.step()
            except Exception as exc:  # a fault of the loop itself: what runs fails, the engine serves on
                log.exception("engine step failed")
                for seq in list(self.scheduler.running):
                    self._outputs.fail(seq, exc)
        self.scheduler.resume_all()  # and the paused ones' blocks
        for seq in list(self.scheduler.running):
            self.scheduler.retire(seq)

    def _run_task(self, task: Task) -> None:
        if not task.future.set_running_or_notify_cancel():
            return
        try:
            with torch.inference_mode():
                task.future.set_result(task.fn())
        except Exception as exc:
            task.future.set_exception(exc)

    def _forward(self, plan: StepPlan) -> StepOutput | None:
        """One forward over the decode rows (first: the batch-invariant split wants them there),
        then the prompt chunks; every row to sample is chosen on the device at once. None when the
        forward failed (its rows fail)."""
        prefill = [seq for seq, _, _ in plan.prefill]
        decode = sorted(plan.decode, key=lambda seq: len(seq.pending) > 1)  # a forced chunk after the rows of one token
        seqs = [*decode, *prefill]
        tokens = [list(seq.pending) for seq in decode] + [seq.prefill_ids[a:b] for seq, a, b in plan.prefill]
        try:
            rows = [seq.row(len(t)) for seq, t in zip(seqs, tokens, strict=True)]
            forward = DeviceSpan(self.device)
            logits = self.runner.forward(tokens, rows)
            forward.end()
        except Exception as exc:
            for seq in seqs:
                self._outputs.fail(seq, exc)
            return None
        finishing = {id(seq) for seq, _, end in plan.prefill if seq.phase is Phase.PROMPT and end == len(seq.prompt)}
        # While the device computes (kernel launches return at once on CUDA), the CPU computes the
        # grammar masks of the rows sampled from these logits.
        sampled = self._outputs.prepare_masks([s for s in seqs if s.phase is Phase.DECODE or id(s) in finishing])
        index = {id(seq): i for i, seq in enumerate(seqs)}
        picks = None
        if sampled:
            at = staged([index[id(seq)] for seq in sampled], torch.long, logits.device)
            picks = device_picks(logits.index_select(0, at), [seq.sampler for seq in sampled])
        return StepOutput(decode, plan.prefill, finishing, sampled, picks, forward, sum(len(t) for t in tokens))

    def _new_sequence(self, job: Job, placement: Placement) -> Sequence:
        return Sequence.admitted(job, placement, self.tokenizer, self.info.special_ids)
