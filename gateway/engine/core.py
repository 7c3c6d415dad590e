"""The engine: the one owner of the model, the KV block pool and the prefix store. Requests are
served by continuous batching on one worker thread, so the event loop never blocks on torch.

The step loop (`_run`), in order:
1. take new work: jobs wait in a bounded queue (429 past `max_queue`); tasks run between steps;
2. admit jobs while fewer than `max_batch` sequences run, in turn between tenants, pausing a
   sequence of a tenant above its share of the batch for one below it (intake.py): look
   the tool group up (RAM, disk), reserve blocks for the rest (evicting unused cached groups if the
   pool is full; a job that does not fit yet waits, one that never can is refused at submit);
3. drop sequences whose client went away, freeing their blocks at once;
4. run one step: one forward over a flat batch of the decoding sequences' next tokens and the
   prompt chunks within the step's token budget, a fair share for each tenant (scheduler.py,
   model_runner.py);
5. sample (rows with nothing but greedy or temperature + top-p: all at once on the device; the
   others per sequence), emit text, and finish sequences that are done: what a step's output
   does to each sequence is outputs.py's. A step of every running sequence's decode row, all
   chosen on the device, may instead start a run of steps each launched before the last one is
   read (`decode_overlap`, `_decode_ahead`).

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
from gateway.engine.cache_manager import HOLD, Hold, KVCacheManager
from gateway.engine.cpu_threads import ThreadGovernor
from gateway.engine.events import CutOff, Job, Task, TooLarge
from gateway.engine.intake import Intake
from gateway.engine.job_stream import JobStream
from gateway.engine.model_info import ModelInfo
from gateway.engine.model_runner import Backend, ModelRunner, tensor_bytes
from gateway.engine.outputs import OutputProcessor
from gateway.engine.sampling import Picks, SamplingParams, device_picks
from gateway.engine.scheduler import Scheduler, StepPlan
from gateway.engine.sequence import Phase, Sequence
from gateway.engine.staging import staged
from gateway.engine.stats import DeviceSpan, EngineStats, StepLog, StepRecord
from gateway.engine.tokenizer import Tokenizer
from gateway.engine.warmup import warm_up
from gateway.kvcache.block_pool import BlockPool
from gateway.kvcache.entry import CacheEntry
from gateway.kvcache.keys import PrefixKey
from gateway.kvcache.store import PrefixStore

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: Any, tokenizer: Tokenizer, info: ModelInfo, store: PrefixStore,
                 *, min_prefix_tokens: int, max_queue: int, device: torch.device,
                 pool_bytes: int = 2 * 1024**3, block_tokens: int = 16, chunk_tokens: int = 128,
                 max_batch: int = 8, turn_opening: tuple[int, ...] = (), conversation_reuse: bool = True,
                 backend: Backend = "torch", batch_invariant: bool = True, graph_tokens: int | None = None,
                 fused: bool = False, overlap: bool = False, threads: ThreadGovernor | None = None) -> None:
        assert info.identity is not None and info.pool_shape is not None, "the engine needs a loaded model's info"
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        self.store = store
        self.device = device
        self.max_batch = max_batch
        # Before the pool: toolkv's own model (or transformers' eager fallback, torch attention only).
        step_model = models.build(model, backend, owned=fused)
        backend = backend if step_model.kind == "owned" else "torch"
        self.pool = BlockPool(info.pool_shape, pool_bytes, block_tokens, device)
        self.runner = ModelRunner(step_model, device, self.pool, backend=backend, batch_invariant=batch_invariant,
                                  weights_bytes=tensor_bytes(model))
        # CUDA graphs, of chunk steps up to this many tokens (None: none; engine/cuda_graphs.py)
        self.graph_tokens = graph_tokens if backend == "triton" and device.type == "cuda" else None
        self.overlap = overlap  # decode steps launched one ahead (_decode_ahead)
        self.threads = threads  # torch's CPU threads, fewer while other work holds the cores (cpu_threads.py)
        self.ahead_steps = 0  # decode steps launched before the one before them was read
        self.scheduler = Scheduler(chunk_tokens, batch_invariant)
        self.cache = KVCacheManager(store, self.pool, info.identity, chunk_tokens=chunk_tokens,
                                    min_prefix_tokens=min_prefix_tokens, turn_opening=turn_opening,
                                    conversation_reuse=conversation_reuse, pool_only=self.runner.reads_pool_only)
        self._intake = Intake(max_queue)
        self._running: list[Sequence] = []
        self._outputs = OutputProcessor(self._running, self.cache, info.eos_ids, self._readmit)
        self._thread = threading.Thread(target=self._run, name="toolkv-engine", daemon=True)
        for owned in (store.owner, self.pool.owner):  # changed on this thread only, once it runs (kvcache/owner.py)
            owned.bind(self._thread, self.call)
        self._steps = StepLog()
        self.num_steps = 0
        self.num_cancelled = 0  # sequences stopped because their client went away
        self.decode_steps = 0
        self.decode_s = 0.0

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
            self._intake.resume_all(self._running)  # a paused generation is running too
            for seq in list(self._running):
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
        future: Future[tuple[CacheEntry, bool]] = Future()
        job = Job(list(key.token_ids), len(key.token_ids), SamplingParams(max_tokens=1), emit=lambda _: None,
                  group_id=group_id, tool_names=tool_names, warm=future)
        job.submitted = time.perf_counter()
        self._intake.put(job)
        return future

    def forget_conversations(self) -> Future[int]:
        """Drop every conversation record (on the engine thread, between steps); the future gives
        how many there were. Raises QueueFull."""
        return self.call(self.cache.conversations.clear)

    def stats(self) -> EngineStats:
        cache = self.cache
        conversations = cache.conversations
        return EngineStats(running=len(self._running), waiting=self._intake.depth,
                           kv_blocks_total=self.pool.num_blocks, kv_blocks_used=self.pool.num_used,
                           kv_blocks_cached=cache.cached_blocks(), kv_block_tokens=self.pool.block_tokens,
                           preemptions_total=self._intake.num_paused,
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
        return self._steps.drain()

    @property
    def queue_depth(self) -> int:
        return self._intake.depth

    @property
    def busy(self) -> bool:
        return bool(self._running)

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

    def _run(self) -> None:
        while self._intake.take(bool(self._running), self._run_task):
            try:
                self._intake.admit(self._running, self.max_batch, self._admit_one, self._outputs.fail_job)
                self._drop_cancelled()
                plan = self.scheduler.plan(self._running)
                if plan:
                    if self.threads is not None:
                        self.threads.adjust()
                    self._step(plan)
            except Exception as exc:  # a fault of the loop itself: what runs fails, the engine serves on
                log.exception("engine step failed")
                for seq in list(self._running):
                    self._outputs.fail(seq, exc)
        self._intake.resume_all(self._running)  # and the paused ones' blocks
        for seq in self._running:
            seq.release()
        self._running.clear()

    def _run_task(self, task: Task) -> None:
        if not task.future.set_running_or_notify_cancel():
            return
        try:
            with torch.inference_mode():
                task.future.set_result(task.fn())
        except Exception as exc:
            task.future.set_exception(exc)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._running if s.job.cancelled.is_set()]:
            self.num_cancelled += 1
            self._outputs.retire(seq)

    def _step(self, plan: StepPlan) -> None:
        """One forward over the decode rows (first: the batch-invariant split wants them there),
        then the prompt chunks; every row to sample is chosen on the device at once, and the
        prompts' first tokens are taken before the decode rows' tokens."""
        if self.overlap and self._may_start_ahead(plan):
            self._decode_ahead(plan.decode)
            return
        started = time.perf_counter()
        step = DeviceSpan(self.device)  # on CUDA the device's time, not the launches' (the step log)
        prefill = [seq for seq, _, _ in plan.prefill]
        decode = sorted(plan.decode, key=lambda seq: len(seq.pending) > 1)  # a forced chunk after the rows of one token
        seqs = [*decode, *prefill]
        tokens = [list(seq.pending) for seq in decode] + [seq.prompt[a:b] for seq, a, b in plan.prefill]
        try:
            rows = [seq.row(len(t)) for seq, t in zip(seqs, tokens, strict=True)]
            forward = DeviceSpan(self.device)
            logits = self.runner.forward(tokens, rows)
            forward.end()
        except Exception as exc:
            for seq in seqs:
                self._outputs.fail(seq, exc)
            return
        finishing = {id(seq) for seq, _, end in plan.prefill if seq.phase is Phase.PROMPT and end == len(seq.prompt)}
        # While the device computes (kernel launches return at once on CUDA), the CPU computes the
        # grammar masks of the rows sampled from these logits.
        sampled = self._outputs.prepare_masks([s for s in seqs if s.phase is Phase.DECODE or id(s) in finishing])
        index = {id(seq): i for i, seq in enumerate(seqs)}
        picks = None
        if sampled:
            at = staged([index[id(seq)] for seq in sampled], torch.long, logits.device)
            picks = device_picks(logits.index_select(0, at), [seq.sampler for seq in sampled])
        for seq, _, end in plan.prefill:
            self._outputs.chunk_done(seq, end, forward)
        read = dict(zip((id(seq) for seq in sampled), picks.read() if picks is not None else (), strict=True))
        for seq in prefill:
            if id(seq) in finishing and id(seq) in read:
                self._outputs.prompt_done(seq, read[id(seq)])
        for seq in decode:
            if id(seq) in read:
                self._outputs.take_picked(seq, read[id(seq)])
        if plan.decode:
            self.decode_s += time.perf_counter() - started
            self.decode_steps += 1
        self.num_steps += 1
        self._steps.add_span(len(seqs), sum(len(t) for t in tokens), step.end())

    def _decode_ahead(self, seqs: list[Sequence]) -> None:
        """Decode steps back to back, each launched before the tokens of the one before it are
        read: its token ids are that step's picks (`device_picks`), copied on the device, so the
        host's reading, detokenizing, streaming and grammar work overlap the next forward (on CUDA,
        where a launch returns at once). A row's inputs are those `_step` would give it; a step
        launched ahead still holds the rows that end on the token being read, so its batch can be
        larger than `_step`'s, which changes rounding only where batches do (not with
        `batch_invariant`; never for a request alone). Penalties count each pick on the device,
        so they need no read; logprobs and `logit_bias` are per-row tensors.

        A row with a grammar runs ahead on a guess, checked before anything uses it: the mask of
        the step launched ahead depends on the token not read yet, so that step is sampled with
        the mask of the step being read (vLLM does not run grammar rows ahead at all; a speculative
        mask checked afterwards keeps the overlap where grammars spend most tokens: free text
        under `tool_choice: auto`, whose mask is the same token after token, and long strings).
        Once the token is read and the grammar follows it, the row's real mask is computed; if it
        equals the guess and nothing is forced, the pick was made exactly as `_step` makes it. If
        not, the row's pick of the step in flight is dropped (its penalty count taken back, its
        random stream rewound: `Sampler.mark`), the run ends, and `_step` feeds the token again
        with the tokens forced after it, rewriting the same KV slot: what the sequence writes is
        what it writes without steps launched ahead.

        The run starts from a step of every running sequence, one token each (`_may_start_ahead`),
        and a step is launched ahead only while nothing else waits that could run
        (`_may_run_ahead`), no guess failed, and no row reaches `max_tokens` with the token being
        read; so the run ends within one step of any of these, and `_run` takes over. A row that
        stops on the token being read (end of sequence, a stop string, non-finite logits) has one
        step computed past its end: its KV goes to the next slot of its own run (reserved for
        `max_tokens`), which nothing reads, and its logits are dropped. A forward that fails raises
        to `_run`, which fails every running row: all of them are in the run."""
        seqs = self._outputs.prepare_masks(seqs)
        if not seqs:
            return
        flight: tuple[list[Sequence], Picks] | None = (seqs, self._launch(seqs, None))
        wrong: set[int] = set()  # rows whose pick in flight was made on a wrong guess
        last_read = time.perf_counter()
        while flight is not None:
            seqs, picks = flight
            running = {id(seq) for seq in self._running}
            alive = [i for i, seq in enumerate(seqs) if id(seq) in running]
            ahead = None
            if not wrong and self._may_run_ahead([seqs[i] for i in alive]):
                ahead_seqs = [seqs[i] for i in alive]
                ahead = (ahead_seqs, self._launch(ahead_seqs, picks.best, alive))
                self.ahead_steps += 1
            read = picks.read()
            for i in alive:
                if id(seqs[i]) in wrong:
                    seqs[i].sampler.dropped(read[i].token)
                else:
                    self._outputs.take_picked(seqs[i], read[i])  # a row that fails fails alone
            wrong = self._wrong_guesses(ahead[0]) if ahead is not None else set()
            now = time.perf_counter()
            self.decode_s += now - last_read
            self.decode_steps += 1
            self.num_steps += 1
            self._steps.add(StepRecord(len(alive), len(alive), now - last_read))
            last_read = now
            flight = ahead

    def _wrong_guesses(self, seqs: list[Sequence]) -> set[int]:
        """The rows of the step in flight whose grammar mask was guessed wrong (see
        `_decode_ahead`): computed now that the token before it is read."""
        running = {id(seq) for seq in self._running}
        guessed = [seq for seq in seqs if seq.sampler.guess is not None and id(seq) in running]
        wrong = {id(seq) for seq in guessed if len(seq.pending) != 1}
        for seq in self._outputs.prepare_masks([seq for seq in guessed if id(seq) not in wrong]):
            constraint, guess = seq.sampler.constraint, seq.sampler.guess
            assert constraint is not None and constraint.bitmask is not None and guess is not None
            if not torch.equal(constraint.bitmask, guess):
                wrong.add(id(seq))
        return wrong

    def _may_start_ahead(self, plan: StepPlan) -> bool:
        """Whether `plan` may start a run of decode steps launched ahead: a step of every running
        sequence's decode row, one token each (not a chunk of forced tokens)."""
        return not plan.prefill and len(plan.decode) == len(self._running) and all(
            len(seq.pending) == 1 for seq in plan.decode)

    def _may_run_ahead(self, seqs: list[Sequence]) -> bool:
        """Whether the next step may be launched before this one is read: nothing waits that
        could run (a held job of a tenant at its share of a full batch cannot: a row must end
        first; intake.py `waiting_turn`), no client is gone, and no row ends by `max_tokens` with
        the token being read."""
        if self._intake.waiting_turn(self._running, self.max_batch):
            return False
        return bool(seqs) and all(
            not seq.job.cancelled.is_set() and seq.generated + 1 < seq.job.params.max_tokens for seq in seqs)

    def _launch(self, seqs: list[Sequence], after: torch.Tensor | None, rows: list[int] | None = None) -> Picks:
        """One decode step of `seqs`: their next tokens from the host, or the picks `after` of the
        step before (at its `rows`), one token past what the host has read; a grammar row launched
        ahead guesses its mask (`_decode_ahead`)."""
        tokens = [list(seq.pending) for seq in seqs]  # `ids`, when given, replace them
        ids = after
        if after is not None and rows is not None and len(rows) < after.shape[0]:
            # rows that ended on the step being read are left out (staged: no wait for the step in flight)
            ids = after.index_select(0, staged(rows, torch.long, after.device))
        rows_kv = [seq.row(1, ahead=int(after is not None)) for seq in seqs]
        logits = self.runner.forward(tokens, rows_kv, ids)
        for seq in seqs:
            seq.sampler.mark(logits.device, guessed=after is not None)
        return device_picks(logits, [seq.sampler for seq in seqs])

    # ---- admission ---------------------------------------------------------------------------

    def _admit_one(self, job: Job, recompute: bool = False) -> Sequence | Hold | None:
        """A running sequence for `job` with all its blocks, HOLD (not now), or None (nothing to run)."""
        placement = self.cache.admit(job, recompute)
        if placement is HOLD or placement is None:
            return placement
        seq = Sequence.admitted(job, placement, self.tokenizer, self.info.special_ids)
        if seq.phase is Phase.GROUP:
            self.cache.start_compiling(seq)
        return seq

    def _readmit(self, job: Job) -> None:
        """Admit `job` again, computing its group privately (its cached copy was bad); held ahead
        of every other job when it does not fit now."""
        again = self._admit_one(job, recompute=True)
        if again is HOLD:
            self._intake.hold_first(job)
        elif again is not None:
            self._running.append(again)
