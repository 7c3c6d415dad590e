"""The engine: the one owner of the model, the KV block pool and the prefix store. Requests are
served by continuous batching on one worker thread, so the event loop never blocks on torch.

The step loop (`_run`), in order:
1. take new work: jobs wait in a bounded queue (429 past `max_queue`); tasks run between steps;
2. admit jobs while fewer than `max_batch` sequences run: look the tool group up (RAM, disk),
   reserve blocks for the rest (evicting unused cached groups if the pool is full; a job that does
   not fit yet waits, one that never can is refused at submit);
3. drop sequences whose client went away, freeing their blocks at once;
4. run one step: one forward over a flat batch of every decoding sequence's next token and the
   prompt chunks within the step's token budget (scheduler.py, model_runner.py);
5. sample (the plain greedy rows in one batched argmax on the device, the others per sequence),
   emit text, and finish sequences that are done.

A hit reads the stored group's blocks in place; a miss computes them (in chunks, between other
sequences' steps) and stores them, starting from the longest prefix it shares with a cached group
(a tool list that differs from a cached one at its end); a bypass computes them privately. After
the group, a request starts from the longest prefix of an earlier request's prompt in its tenant's
conversation records (prefix_index.py), copied into its own blocks, and computes only the rest;
when it ends, its prompt's KV is kept as a record for its conversation's next turn. All three run the same
operations on the same numbers, so their output is identical (model_runner.py says why). A cached
group whose logits come out NaN or infinite (a poisoned file passes its checksum when its writer
had write access) is dropped and the request recomputed; only a model that gives non-finite
logits by itself fails.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal

import torch

from gateway.engine.block_pool import BlockPool, BlockRun
from gateway.engine.chunks import chunk_ends, next_end
from gateway.engine.cuda_graphs import StepGraphs
from gateway.engine.events import (
    CacheResult,
    Failed,
    Finished,
    Job,
    Prefilled,
    QueueFull,
    Task,
    TextDelta,
    TooLarge,
)
from gateway.engine.model_info import eos_ids, pool_shape, special_ids
from gateway.engine.model_runner import Backend, ModelRunner, RowKV
from gateway.engine.prefix_index import Conversations, GroupIndex, Record, chain_hashes
from gateway.engine.sampling import NonFiniteLogits, Sampler, SamplingParams, TextStream, all_finite
from gateway.engine.scheduler import Scheduler, StepPlan
from gateway.engine.sequence import Phase, Sequence
from gateway.engine.stats import EngineStats, StepLog, StepRecord
from gateway.kvcache.entry import CacheEntry
from gateway.kvcache.keys import CacheIdentity, PrefixKey
from gateway.kvcache.store import PrefixStore

log = logging.getLogger(__name__)

FIRST_TOKEN_HANDOFF_S = 0.05
_IDLE_WAIT_S = 0.05  # a held job with nothing running re-checks the pool this often


class _Hold(Exception):
    """The job cannot be admitted yet (blocks, or its group is being compiled by another)."""


class Engine:
    def __init__(self, model: Any, tokenizer: Any, store: PrefixStore, identity: CacheIdentity,
                 *, min_prefix_tokens: int, max_queue: int, device: torch.device,
                 pool_bytes: int = 2 * 1024**3, block_tokens: int = 16, chunk_tokens: int = 128,
                 max_batch: int = 8, turn_opening: tuple[int, ...] = (), backend: Backend = "torch",
                 batch_invariant: bool = True, cuda_graphs: bool = False) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.store = store
        self.identity = identity
        self.min_prefix_tokens = min_prefix_tokens
        self.device = device
        self.max_batch = max_batch
        self.eos_ids = eos_ids(model, tokenizer)
        self.special_ids = special_ids(tokenizer)
        self.pool = BlockPool(pool_shape(model), pool_bytes, block_tokens, device)
        self.runner = ModelRunner(model, device, self.pool, backend=backend, batch_invariant=batch_invariant)
        self.cuda_graphs = cuda_graphs and backend == "triton" and device.type == "cuda"
        self.scheduler = Scheduler(chunk_tokens)
        self.turn_opening = turn_opening  # where prompt chunks are cut (chunks.py)
        self.conversation_reuse = True  # keep finished prompts' KV for the next turn, and use it
        self.conversations = Conversations(block_tokens)
        self.groups = GroupIndex(block_tokens, chunk_tokens, store.ram.holds)
        self._intake: queue.Queue[Job | Task | None] = queue.Queue(maxsize=max_queue)
        self._held: list[Job] = []
        self._running: list[Sequence] = []
        self._compiling: dict[str, Sequence] = {}  # group digest -> the sequence computing it
        self._thread = threading.Thread(target=self._run, name="toolkv-engine", daemon=True)
        self._steps = StepLog()
        self.num_steps = 0
        self.num_cancelled = 0  # sequences stopped because their client went away
        self.num_preempted = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.conversation_hit_tokens = 0
        self.constrained_tokens = 0
        self.constraint_s = 0.0
        self.decode_steps = 0
        self.decode_s = 0.0

    # ---- public API ------------------------------------------------------------------------

    def start(self) -> None:
        """Warm up, then serve: the runtime (and so `/health`) is ready only after this."""
        self.warm_up()
        self._thread.start()

    def warm_up(self) -> None:
        """What a first request would otherwise pay once: one pass of each shape the engine runs
        (a whole prompt chunk, one decode row; kernels compile, allocators settle), and on CUDA the
        decode graphs. Before the engine thread starts, so it owns the model alone here."""
        started = time.perf_counter()
        chunk = max(1, min(self.scheduler.chunk_tokens, self.pool.num_blocks * self.pool.block_tokens - 1))
        run = self.pool.allocate(chunk + 1)
        if run is not None:
            try:
                self.runner.forward([[0] * chunk], [RowKV(None, run, 0, 0)])
                self.runner.forward([[0]], [RowKV(None, run, chunk, chunk)])
            finally:
                run.release()
        if self.cuda_graphs:
            graphs = StepGraphs(self.runner, self.max_batch)
            try:
                graphs.capture()
                self.runner.graphs = graphs
            except Exception:  # a model whose forward cannot be captured still serves, eagerly
                log.warning("CUDA graph capture failed; decode runs eagerly", exc_info=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("engine warm-up: %.1fs (%s attention, batch invariant %s, CUDA graphs %s)",
                 time.perf_counter() - started, self.runner.backend, self.runner.batch_invariant,
                 self.runner.graphs is not None)

    def stop(self) -> None:
        self._intake.put(None)
        self._thread.join(timeout=30)
        self.store.close()  # finish pending disk writes, so a restart finds them

    def submit(self, job: Job) -> None:
        """Queue a generation; its events arrive through `job.emit`. Raises QueueFull when too
        many wait, TooLarge when the pool could never hold it."""
        if self._blocks_needed(job) > self.pool.num_blocks:
            raise TooLarge(f"the request needs {len(job.prompt_ids) + job.params.max_tokens} tokens of KV; "
                           f"the KV pool holds {self.pool.num_blocks * self.pool.block_tokens}")
        job.submitted = time.perf_counter()
        try:
            self._intake.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    def abort(self, job: Job) -> None:
        """Stop a job wherever it is (queued, waiting or running); its blocks are freed."""
        job.cancelled.set()

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` on the engine thread, between steps; its result arrives in the future."""
        task = Task(fn)
        try:
            self._intake.put_nowait(task)
        except queue.Full:
            raise QueueFull from None
        return task.future

    def warm(self, key: PrefixKey, group_id: str, tool_names: tuple[str, ...]) -> Future[tuple[CacheEntry, bool]]:
        """Make sure the group `key` (in the shared namespace) is cached: found in RAM or on disk,
        or computed like a request's group, in chunks between other requests' steps. The future
        gives the entry and whether it was cached already. Raises QueueFull."""
        future: Future[tuple[CacheEntry, bool]] = Future()
        job = Job(list(key.token_ids), len(key.token_ids), SamplingParams(max_tokens=1), emit=lambda _: None,
                  group_id=group_id, tool_names=tool_names, warm=future)
        job.submitted = time.perf_counter()
        try:
            self._intake.put_nowait(job)
        except queue.Full:
            raise QueueFull from None
        return future

    def forget_conversations(self) -> Future[int]:
        """Drop every conversation record (on the engine thread, between steps); the future gives
        how many there were. Raises QueueFull."""
        return self.call(self.conversations.clear)

    def stats(self) -> EngineStats:
        cached = sum(self.pool.blocks_for(e.num_tokens) for e in self.store.ram.entries() if e.blocks is not None)
        cached += self.conversations.num_blocks
        return EngineStats(running=len(self._running), waiting=self._intake.qsize() + len(self._held),
                           kv_blocks_total=self.pool.num_blocks, kv_blocks_used=self.pool.num_used,
                           kv_blocks_cached=cached, kv_block_tokens=self.pool.block_tokens,
                           preemptions_total=self.num_preempted,
                           prefix_queries_tokens_total=self.prefix_query_tokens,
                           prefix_hits_tokens_total=self.prefix_hit_tokens, steps_total=self.num_steps,
                           cancelled_total=self.num_cancelled, conversation_records=len(self.conversations),
                           conversation_blocks=self.conversations.num_blocks,
                           conversation_hits_tokens_total=self.conversation_hit_tokens,
                           conversation_evictions_total=self.conversations.evictions,
                           constrained_tokens_total=self.constrained_tokens,
                           constraint_seconds_total=self.constraint_s,
                           decode_steps_total=self.decode_steps, decode_seconds_total=self.decode_s)

    def drain_steps(self) -> list[StepRecord]:
        return self._steps.drain()

    @property
    def queue_depth(self) -> int:
        return self._intake.qsize() + len(self._held)

    @property
    def busy(self) -> bool:
        return bool(self._running)

    def key_for(self, prefix_ids: list[int], salt: str = "") -> PrefixKey:
        identity = self.identity if not salt else CacheIdentity(
            self.identity.model_fingerprint, self.identity.tokenizer_fingerprint,
            self.identity.adapter_version, salt)
        return PrefixKey.of(identity, prefix_ids)

    def prefill_over(self, entry: CacheEntry, suffix_ids: list[int]) -> None:
        """What a hit computes: `suffix_ids` prefilled after the stored group, in the same chunks,
        into a scratch run that is freed after. Engine thread only (the bench's floor probe)."""
        run = self._allocate(len(suffix_ids))
        if run is None:
            raise TooLarge("the KV pool has no room for the suffix now")
        try:
            group = [(layer.keys[0], layer.values[0]) for layer in entry.layers]
            group_start = entry.blocks.token_start if entry.blocks is not None else -1
            prompt, start = [*entry.key.token_ids, *suffix_ids], entry.num_tokens
            ends = chunk_ends(prompt, start, self.scheduler.chunk_tokens, self.turn_opening)
            done = start
            while done < len(prompt):
                end = next_end(ends, done)
                self.runner.forward([prompt[done:end]], [RowKV(group, run, done - start, done, group_start)])
                done = end
        finally:
            run.release()

    # ---- the step loop -----------------------------------------------------------------------

    def _run(self) -> None:
        while self._take_new_work():
            self._admit()
            self._drop_cancelled()
            plan = self.scheduler.plan(self._running)
            if plan:
                self._step(plan)
        for seq in self._running:
            seq.release()
        self._running.clear()

    def _take_new_work(self) -> bool:
        """Block while idle; otherwise take what is queued without waiting, up to the batch size.
        False once the engine is told to stop."""
        idle = not self._running
        while len(self._running) + len(self._held) < self.max_batch or idle:
            try:
                if idle and not self._held:
                    item = self._intake.get()
                elif idle:
                    item = self._intake.get(timeout=_IDLE_WAIT_S)
                else:
                    item = self._intake.get_nowait()
            except queue.Empty:
                return True
            idle = False
            if item is None:
                return False
            if isinstance(item, Task):
                self._run_task(item)
                idle = not self._running and not self._held
            elif not item.cancelled.is_set():
                self._held.append(item)
        return True

    def _run_task(self, task: Task) -> None:
        if not task.future.set_running_or_notify_cancel():
            return
        try:
            with torch.inference_mode():
                task.future.set_result(task.fn())
        except Exception as exc:
            task.future.set_exception(exc)

    def _admit(self) -> None:
        for job in list(self._held):
            if job.cancelled.is_set():
                self._held.remove(job)
                continue
            try:
                seq = self._sequence_for(job)
            except _Hold:
                continue
            except Exception as exc:
                self._held.remove(job)
                self._fail_job(job, exc)
                continue
            self._held.remove(job)
            if seq is not None:
                self._running.append(seq)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._running if s.job.cancelled.is_set()]:
            self.num_cancelled += 1
            self._retire(seq)

    def _step(self, plan: StepPlan) -> None:
        """One forward over the decode rows (first: the batch-invariant split wants them there) and
        the prompt chunks; chunks are handled first, so a new request's first token waits for no
        sampling of the others."""
        started = time.perf_counter()
        seqs = [*plan.decode, *(seq for seq, _, _ in plan.prefill)]
        tokens = [[seq.next_token] for seq in plan.decode] + [seq.prompt[a:b] for seq, a, b in plan.prefill]
        try:
            rows = [seq.row(len(t)) for seq, t in zip(seqs, tokens, strict=True)]
            logits = self.runner.forward(tokens, rows)  # type: ignore[arg-type]
        except Exception as exc:
            for seq in seqs:
                self._fail(seq, exc)
            return
        decoded = len(plan.decode)
        for index, (seq, _, end) in enumerate(plan.prefill):
            self._chunk_done(seq, end, logits[decoded + index], started)
        if plan.decode:
            self._decode(plan.decode, logits[:decoded])
            self.decode_s += time.perf_counter() - started
            self.decode_steps += 1
        self.num_steps += 1
        self._steps.add(StepRecord(len(plan.decode) + len(plan.prefill), plan.num_tokens,
                                   time.perf_counter() - started))

    # ---- admission ---------------------------------------------------------------------------

    def _blocks_needed(self, job: Job) -> int:
        return self.pool.blocks_for(job.prefix_len) + self.pool.blocks_for(
            len(job.prompt_ids) - job.prefix_len + job.params.max_tokens)

    def _sequence_for(self, job: Job, recompute: bool = False) -> Sequence | None:
        """A running sequence for `job` with all its blocks (None: nothing to run), or _Hold."""
        if job.warm is not None:
            return self._warm_sequence(job)
        admitted = time.perf_counter()
        prompt = job.prompt_ids
        cacheable = self.min_prefix_tokens <= job.prefix_len < len(prompt)
        group_len = job.prefix_len if cacheable else 0
        key: PrefixKey | None = None
        entry: CacheEntry | None = None
        tier: str | None = None
        result: CacheResult = "bypass" if not job.use_cache else "skip"
        if cacheable and job.use_cache and not recompute:
            key = self.key_for(prompt[:group_len], job.salt)
            if key.digest in self._compiling:
                raise _Hold
            entry, tier = self._lookup(key, job.salt)
            result = "hit" if entry is not None else "miss"
        elif recompute:
            result = "miss"
        ends = chunk_ends(prompt, group_len, self.scheduler.chunk_tokens, self.turn_opening)
        chain: list[bytes] = []
        record, rest_from = None, group_len
        source: CacheEntry | None = None
        group_from = 0
        if job.use_cache and not recompute:
            if self.conversation_reuse:  # the chain also keys this request's own record when it ends
                chain = chain_hashes(self._conversation_root(job, group_len), prompt, self.pool.block_tokens)
                record, rest_from = self.conversations.find_turn(prompt, group_len, ends, chain)
            if group_len and entry is None:
                source, group_from = self.groups.longest(self._group_root(job.salt), prompt[:group_len])
        lookup_s = time.perf_counter() - admitted
        # Hold the blocks to copy from while allocating: making room may evict their holders.
        held = [r for r in (record.run if record else None, source.blocks if source else None) if r is not None]
        for run in held:
            run.retain()
        try:
            own_run, group_run = self._allocate_runs(len(prompt) - group_len + job.params.max_tokens,
                                                     group_len if entry is None else 0)
            if own_run is None:
                if entry is not None:
                    self._let_go(entry)
                raise _Hold
            if record is not None and rest_from > group_len:
                own_run.copy_from(record.run, rest_from - group_len)
            if group_run is not None and source is not None and source.blocks is not None and group_from:
                group_run.copy_from(source.blocks, group_from)
        finally:
            for run in held:
                run.release()
        seq = Sequence(job, group_len, result, own_run, ends, Sampler(job.params, job.constraint),
                       TextStream(self.tokenizer, job.params.stop, self.special_ids, job.keep_token_ids),
                       key=key, entry=entry, group_run=group_run, tier=tier, admitted_at=admitted,
                       lookup_s=lookup_s, chain=chain, source=record, rest_from=rest_from)
        seq.reused = (group_len if entry is not None else group_from) + rest_from - group_len
        if group_run is not None:
            seq.phase = Phase.GROUP
            seq.computed = group_from
            seq.compile_started = admitted
            if result == "miss" and key is not None:
                self._compiling[key.digest] = seq
        else:
            seq.computed = rest_from
        if job.use_cache:
            self.prefix_query_tokens += len(prompt)
            self.prefix_hit_tokens += seq.reused
            self.conversation_hit_tokens += rest_from - group_len
        return seq

    def _allocate_runs(self, own_tokens: int, group_tokens: int) -> tuple[BlockRun | None, BlockRun | None]:
        """The sequence's own run and (when it computes its group) the group's run; (None, None)
        when they do not both fit now."""
        own_run = self._allocate(own_tokens)
        if own_run is None or not group_tokens:
            return own_run, None
        group_run = self._allocate(group_tokens)
        if group_run is None:
            own_run.release()
            return None, None
        return own_run, group_run

    def _conversation_root(self, job: Job, group_len: int) -> bytes:
        """The root of a prompt's block chain: identity, the tenant's namespace, the group's length
        (it decides where the chunks are cut)."""
        return self.identity.digest_bytes() + f"\x00conversation\x00{job.tenant}\x00{group_len}".encode()

    def _group_root(self, salt: str) -> bytes:
        return self.key_for([], salt).digest.encode()

    def _warm_sequence(self, job: Job) -> Sequence | None:
        """A sequence that only computes and stores its group; None when the group is cached."""
        assert job.warm is not None
        key = self.key_for(job.prompt_ids)
        if key.digest in self._compiling:
            raise _Hold
        found = self.store.lookup(key)
        if found is not None:
            job.warm.set_result((found.entry, True))
            return None
        group_run = self._allocate(len(key.token_ids))
        own_run = self._allocate(1) if group_run is not None else None
        if group_run is None or own_run is None:
            if group_run is not None:
                group_run.release()
            raise _Hold
        ends = chunk_ends(key.token_ids, len(key.token_ids), self.scheduler.chunk_tokens, self.turn_opening)
        seq = Sequence(job, len(key.token_ids), "miss", own_run, ends, Sampler(job.params, job.constraint),
                       TextStream(self.tokenizer, (), self.special_ids), key=key, group_run=group_run,
                       phase=Phase.GROUP, compile_started=time.perf_counter())
        self._compiling[key.digest] = seq
        return seq

    def _lookup(self, key: PrefixKey, salt: str) -> tuple[CacheEntry | None, str | None]:
        """The stored group, with a reference and a lock held for the sequence; None on a miss."""
        found = self.store.lookup(key)
        if found is None:
            return None, None
        entry = found.entry
        entry.touch()
        if entry.blocks is None:  # read from disk: copy it into the pool (when there is room)
            entry = self._place(entry, salt)
            if entry.blocks is None and self.runner.reads_pool_only:
                raise _Hold  # the kernels read only the pool: wait until there is room for it
        else:
            entry.retain()
        self.store.lock(entry)
        return entry, found.tier

    def _place(self, loaded: CacheEntry, salt: str) -> CacheEntry:
        run = self._allocate(loaded.num_tokens)
        if run is None:
            return loaded  # used from its own tensors this once
        for index, layer in enumerate(loaded.layers):
            run.keys(index, 0, loaded.num_tokens).copy_(layer.keys[0])
            run.values(index, 0, loaded.num_tokens).copy_(layer.values[0])
        entry = CacheEntry(key=loaded.key, layers=run.entry_layers(loaded.num_tokens), group_id=loaded.group_id,
                           tool_names=loaded.tool_names, compile_s=loaded.compile_s,
                           created_at=loaded.created_at, last_used_at=loaded.last_used_at, hits=loaded.hits,
                           blocks=run)
        self.store.keep_in_ram(entry)  # replaces the loaded copy; the run's reference is the sequence's
        self.groups.add(entry, self._group_root(salt))
        return entry

    def _let_go(self, entry: CacheEntry) -> None:
        self.store.unlock(entry)
        entry.release()

    def _allocate(self, tokens: int) -> BlockRun | None:
        """A run for `tokens`, making room by dropping conversation records, then cached groups
        nobody uses (least recently used first)."""
        while (run := self.pool.allocate(tokens)) is None:
            if not self.conversations.evict_oldest() and not self.store.evict_oldest():
                return None
        return run

    # ---- running -----------------------------------------------------------------------------

    def _decode(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample each decode row: the plain greedy ones by one argmax over their rows on the
        device (one transfer for all), the others per sequence, from one copy of their rows."""
        plain = [i for i, seq in enumerate(seqs) if seq.sampler.plain]
        picked: dict[int, tuple[int, int]] = {}
        if plain:
            rows = logits if len(plain) == len(seqs) else logits[plain]
            best, ok = torch.argmax(rows, dim=-1), torch.isfinite(rows.amax(dim=-1))
            picked = dict(zip(plain, zip(*torch.stack([best, ok.long()]).tolist(), strict=True), strict=True))
        others = [i for i in range(len(seqs)) if i not in picked]
        host = dict(zip(others, self._host(logits[others]) if others else (), strict=True))
        for index, seq in enumerate(seqs):
            try:
                if index in picked:
                    token, finite = picked[index]
                    if not finite:
                        raise NonFiniteLogits("the model produced non-finite logits")
                    self._take(seq, token)
                else:
                    self._advance(seq, host[index])
            except Exception as exc:  # non-finite logits, a grammar that refused a token: this one only
                self._fail(seq, exc)

    def _host(self, logits: torch.Tensor) -> torch.Tensor:
        """Rows a sequence samples from itself (penalties, grammar, logprobs, temperature): on the
        CPU, where its sampler keeps its state, in one copy."""
        return logits.cpu() if logits.device.type != "cpu" else logits

    def _chunk_done(self, seq: Sequence, end: int, logits: torch.Tensor, started: float) -> None:
        try:
            if seq.phase is Phase.PROMPT:
                seq.forward_s += time.perf_counter() - started
            seq.computed = end
            if seq.phase is Phase.GROUP and end == seq.group_len:
                self._group_done(seq)
            elif seq.phase is Phase.PROMPT and end == len(seq.prompt):
                self._prompt_done(seq, logits if seq.sampler.plain else self._host(logits))
        except Exception as exc:
            self._fail(seq, exc)

    def _group_done(self, seq: Sequence) -> None:
        seq.phase = Phase.PROMPT
        seq.computed = seq.rest_from  # an earlier turn's KV may already be in the own run
        seq.compile_s = time.perf_counter() - seq.compile_started
        if seq.result != "miss" or seq.key is None:
            return  # a bypass keeps its group to itself
        assert seq.group_run is not None
        self._compiling.pop(seq.key.digest, None)
        seq.entry = self._store_group(seq.key, seq.group_run, seq.job, seq.compile_s)
        if seq.job.warm is not None:
            self._retire(seq)
            seq.job.warm.set_result((seq.entry, False))

    def _store_group(self, key: PrefixKey, run: BlockRun, job: Job, compile_s: float) -> CacheEntry:
        entry = CacheEntry(key=key, layers=run.entry_layers(len(key.token_ids)), group_id=job.group_id,
                           tool_names=job.tool_names, compile_s=compile_s, blocks=run)
        self.store.insert(entry)
        self.groups.add(entry, self._group_root(job.salt))
        log.info("compiled tool group %s: %d tokens in %.2fs (%.1f MB of KV)", job.group_id or "-",
                 len(key.token_ids), compile_s, entry.num_bytes / 1e6)
        return entry

    def _prompt_done(self, seq: Sequence, logits: torch.Tensor) -> None:
        if not all_finite(logits):
            if seq.result == "hit" and seq.entry is not None:
                self.store.quarantine(seq.entry, "nonfinite", "its KV gave non-finite logits")
                self._recompute(seq)
                return
            raise _NonFinite("the model gave non-finite logits on a plain prefill")
        now = time.perf_counter()
        job = seq.job
        job.emit(Prefilled(len(seq.prompt), seq.reused, seq.result, seq.tier, 0.0, seq.compile_s,
                           now - seq.admitted_at, seq.forward_s,
                           seq.admitted_at - job.submitted if job.submitted else 0.0, seq.lookup_s))
        seq.phase = Phase.DECODE
        if job.params.max_tokens <= 0:  # the answer is wholly forced (e.g. a call with no arguments)
            self._finish(seq, "length", 0)
            return
        self._advance(seq, logits)

    def _recompute(self, seq: Sequence) -> None:
        """Start `seq` again, computing its group privately (its cached copy was bad)."""
        self._retire(seq)
        try:
            again = self._sequence_for(seq.job, recompute=True)
            if again is not None:
                self._running.append(again)
        except _Hold:
            self._held.insert(0, seq.job)

    def _advance(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample the next token of `seq`, emit its text, and finish it or queue the token."""
        token = seq.sampler.next_token(logits)
        if seq.sampler.constraint is not None:
            self.constrained_tokens += 1
            self.constraint_s += seq.sampler.constraint_s
        self._take(seq, token)

    def _take(self, seq: Sequence, token: int) -> None:
        """`token` is the next token of `seq`: emit its text, and finish or queue it."""
        job = seq.job
        seq.generated += 1
        if token in self.eos_ids:
            self._finish(seq, "stop", seq.generated - 1)
            return
        delta = seq.stream.push(token)
        if seq.sampler.last_logprob is not None:  # (after the end-of-sequence check: that one is no answer's)
            seq.logprobs.hold(seq.sampler.last_logprob, seq.stream.text_chars)
        if delta or seq.stream.stopped:
            self._emit_text(seq, delta, seq.stream.emitted_chars)
        if delta and job.first_token_sent is not None and not seq.first_token_handed_off:
            seq.first_token_handed_off = True
            job.first_token_sent.wait(FIRST_TOKEN_HANDOFF_S)
        if seq.stream.stopped:
            self._retire(seq, keep_turn=True)  # blocks are free before the client hears it is done
            job.emit(Finished("stop", seq.generated, tuple(seq.stream.token_ids)))
            return
        if seq.generated >= job.params.max_tokens:
            self._finish(seq, "length", job.params.max_tokens)
            return
        seq.next_token = token

    def _finish(self, seq: Sequence, reason: Literal["stop", "length"], count: int) -> None:
        self._retire(seq, keep_turn=True)  # blocks are free before the client hears it is done
        self._emit_text(seq, seq.stream.flush(), None)
        seq.job.emit(Finished(reason, count, tuple(seq.stream.token_ids)))

    def _emit_text(self, seq: Sequence, text: str, sent_chars: int | None) -> None:
        """Send `text` (the answer is `sent_chars` characters long with it; None: all of it) with
        the logprobs of the tokens whose text it completes."""
        logprobs = seq.logprobs.release(sent_chars, cut=seq.stream.stopped)
        if text or logprobs:
            seq.job.emit(TextDelta(text, logprobs))

    def _retire(self, seq: Sequence, keep_turn: bool = False) -> None:
        """Take `seq` out of the batch and give its blocks back; `keep_turn`: keep its prompt's KV
        (after the group) as a conversation record first."""
        if keep_turn:
            self._keep_turn(seq)
        if seq in self._running:
            self._running.remove(seq)
        if seq.key is not None and self._compiling.get(seq.key.digest) is seq:
            del self._compiling[seq.key.digest]
        if seq.entry is not None and seq.result == "hit":
            self.store.unlock(seq.entry)
        seq.release()

    def _keep_turn(self, seq: Sequence) -> None:
        """Index the prompt KV of a finished sequence for its conversation's next turn. Only the
        prompt: the generated tokens' KV came from decode passes, and the next turn's prompt would
        compute them in a prefill chunk, with other bits (engine/chunks.py)."""
        job = seq.job
        own_tokens = len(seq.prompt) - seq.group_len
        if not self.conversation_reuse or not job.use_cache or job.warm is not None or \
                seq.phase is not Phase.DECODE or own_tokens <= 0:
            return
        record = Record(tuple(seq.prompt), seq.group_len, frozenset(seq.ends), seq.own_run.head(own_tokens),
                        seq.chain)
        self.conversations.add(record, replaces=seq.source)

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        self._retire(seq)  # before the event, as for a finish
        self._fail_job(seq.job, exc)

    def _fail_job(self, job: Job, exc: Exception) -> None:
        log.error("generation failed", exc_info=exc)
        if job.warm is not None:
            job.warm.set_exception(exc)
            return
        # The client sees no exception text: it may hold a path or other server detail.
        job.emit(Failed(f"generation failed ({type(exc).__name__}); the server log has the details"))


class _NonFinite(RuntimeError):
    pass
