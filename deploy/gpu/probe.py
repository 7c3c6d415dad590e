"""Where a decode step's time goes, in process: the second stage of `deploy/gpu/measure.sh`.

    python3 deploy/gpu/probe.py MODEL_DIR [--context 3000] [--batches 1,16,32] [--out probe.json]

Settings come from TOOLKV_* as for `toolkv serve` (the KV pool: TOOLKV_RAM_BUDGET_BYTES). Each part
prints as it finishes and is guarded on its own (its traceback goes in the JSON as `PART_error`), so a
failure in one still leaves the others' numbers; the JSON is rewritten after every part:
  A. the engine as built: owned model or transformers, backend, graphs captured / eager, overlap, memory;
  B. device time of a decode step at each batch, every row reading --context tokens of KV: the graph
     replay alone (CUDA events), a whole step as the engine runs it (forward + device picks + read
     back), and steps launched one ahead (what `_decode_ahead` does), greedy and with a grammar-style
     bitmask on every row (the device sampling path of a request with tools);
  C. a torch.profiler breakdown of decode steps at each batch, replayed from graphs and eager: device
     time per step by category (GEMM, attention, KV write, other small kernels, copies), kernels per
     step, and the device's idle time; then a 32-token chunk over --context keys (a hit's suffix) and
     one eager --long-chunk (a cold group's chunk);
  D. one greedy stream through the service per setting, ms/token from its own deltas: tool_choice
     none and auto (the grammar, sampled on the device), decode steps launched ahead on and off, and
     required (a call's opening forced) with forced tokens as one chunk and one step each; forced and
     constrained tokens counted per stream.
On a machine without CUDA it runs eagerly and prints what it can: a check of the script itself
(tests/deploy/test_gpu_probe.py runs it so on a tiny model, so it cannot drift from the engine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from gateway.bench.data import WORKLOADS
from gateway.engine import Finished, Prefilled, TextDelta
from gateway.engine.model_runner import ModelRunner, RowKV
from gateway.engine.sampling import Picks, Sampler, SamplingParams, device_picks
from gateway.kvcache.block_pool import BlockRun
from gateway.metrics import Metrics
from gateway.protocol.chat import ChatCompletionRequest
from gateway.serving.runtime import Runtime, build_runtime
from gateway.settings import load_settings

CUDA = torch.cuda.is_available()

T = TypeVar("T")


class Probe:
    """The results so far, written to `out` after every part."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.results: dict[str, Any] = {}

    def part(self, name: str, fn: Callable[[], Any]) -> None:
        started = time.perf_counter()
        try:
            self.results[name] = fn()
        except Exception:
            self.results[f"{name}_error"] = traceback.format_exc(limit=8)[-2000:]
            print(f"[{name}] FAILED\n{self.results[f'{name}_error']}", flush=True)
        print(f"[{name}] {time.perf_counter() - started:.1f}s", flush=True)
        self.write()

    def write(self) -> None:
        self.out.write_text(json.dumps(self.results, indent=1, default=str))


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def category(name: str) -> str:
    """A kernel's (or, on the CPU, an aten op's) share of a step."""
    low = name.lower()
    if "memcpy" in low or "memset" in low:
        return "memcpy"
    if any(k in low for k in ("gemm", "gemv", "cutlass", "xmma", "nvjet", "splitk", "cublas", "aten::mm",
                              "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")):
        return "gemm"
    if any(k in low for k in ("attention", "decode_", "prefill_", "combine_", "sdpa", "flash")):
        return "attention"
    if "index_copy" in low or "indexfunc" in low or ("index" in low and "put" in low) or "kv_write" in low:
        return "kv_write"
    return "other"


def kernel_table(prof: Any, steps: int) -> dict[str, Any]:
    """Time per step by category, from a profile of `steps` identical steps: device kernels on
    CUDA; on the CPU (no device events) the aten ops' self CPU time, nested calls included."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    top: list[tuple[float, str, int]] = []
    for event in prof.key_averages():
        on_device = str(getattr(event, "device_type", "")).endswith("CUDA")  # DeviceType.CUDA
        if CUDA and not on_device:
            continue
        if not CUDA and not event.key.startswith("aten::"):
            continue
        us = float(getattr(event, "self_device_time_total", 0.0) or 0.0) if CUDA \
            else float(getattr(event, "self_cpu_time_total", 0.0) or 0.0)
        cat = category(event.key)
        sums[cat] += us / steps
        counts[cat] += event.count // max(steps, 1)
        top.append((us / steps, event.key[:90], event.count // max(steps, 1)))
    top.sort(reverse=True)
    unit = "device kernels" if CUDA else "aten calls (CPU, nested included)"
    return {"unit": unit, "us_per_step": {k: round(v, 1) for k, v in sums.items()},
            "kernels_per_step": dict(counts), "kernels_total_per_step": sum(counts.values()),
            "total_us_per_step": round(sum(sums.values()), 1),
            "top": [{"us": round(us, 1), "n": n, "kernel": k} for us, k, n in top[:14]]}


def rows_for(runner: ModelRunner, count: int, context: int, extra: int = 1) -> tuple[list[RowKV], list[BlockRun]]:
    """`count` rows, each with `context` tokens of KV in its own run and room for `extra` more."""
    runs = [runner.pool.allocate(context + extra + 1) for _ in range(count)]
    held = [r for r in runs if r is not None]
    if len(held) < count:
        for r in held:
            r.release()
        raise RuntimeError(f"the KV pool holds fewer than {count} x {context + extra + 1} tokens")
    return [RowKV(None, r, context, context) for r in held], held


def on_engine(runtime: Runtime, fn: Callable[[], T]) -> T:
    """`fn` on the engine's thread, which alone changes the pool's blocks (kvcache/block_pool.py's `Owner`); the
    forwards themselves run on this thread while the engine waits for work."""
    return cast(T, runtime.engine.call(fn).result())


def release(runs: list[BlockRun]) -> None:
    for r in runs:
        r.release()


def full_masks(vocab: int, rows: int) -> list[torch.Tensor | None]:
    """One packed bitmask per row allowing every token (llguidance's layout: int32 words, on the
    host as a grammar computes them): the device sampling path of a row with a grammar, whose mask
    is copied over and applied there."""
    words = (vocab + 31) // 32
    mask = torch.full((words,), -1, dtype=torch.int32)
    return [mask for _ in range(rows)]


def engine_info(runtime: Runtime) -> dict[str, Any]:
    info = runtime.engine_info()
    runner = runtime.engine.runner
    graphs = runner.graphs
    info["graph_buckets"] = {"decode": list(graphs.decode_sizes), "flat": list(graphs.flat_sizes)} if graphs else None
    info["graph_replays_so_far"] = dict(graphs.replays) if graphs else None
    info["memory_gib"] = {k: round(v / 2**30, 3) for k, v in runner.memory().parts().items()}
    info["layers"] = getattr(runner.model.config, "num_hidden_layers", None)
    if CUDA:
        info["gpu"] = torch.cuda.get_device_name()
        info["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(json.dumps(info, default=str), flush=True)
    return info


def device_times(runtime: Runtime, context: int, batches: list[int], repeats: int) -> dict[str, Any]:
    runner = runtime.engine.runner
    vocab = int(runner.model.config.vocab_size)
    out: dict[str, Any] = {}
    for batch in batches:
        rows, runs = on_engine(runtime, partial(rows_for, runner, batch, context))
        try:
            tokens = [[0]] * batch
            greedy = [Sampler(SamplingParams(max_tokens=8, temperature=0.0)) for _ in range(batch)]
            masks = full_masks(vocab, batch)
            for _ in range(3):
                device_picks(runner.forward(tokens, rows), greedy).read()
            row: dict[str, float] = {}
            graphs = runner.graphs
            if CUDA and graphs is not None:
                runner.forward(tokens, rows)  # writes the static buffers once
                size = next(s for s in graphs.decode_sizes if s >= batch)
                graph = graphs._decode[size].replayable
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                sync()
                start.record()
                for _ in range(repeats):
                    graph.replay()
                end.record()
                end.synchronize()
                row["graph_only_ms"] = start.elapsed_time(end) / repeats
            for label, step_masks in (("greedy", None), ("bitmask", masks)):
                walls = []
                for _ in range(repeats):
                    sync()
                    t = time.perf_counter()
                    device_picks(runner.forward(tokens, rows), greedy, step_masks).read()
                    walls.append((time.perf_counter() - t) * 1e3)
                row[f"step_read_back_ms_{label}"] = statistics.median(walls)
                # back to back, each launched before the last is read (what _decode_ahead does)
                sync()
                t = time.perf_counter()
                picks: Picks = device_picks(runner.forward(tokens, rows), greedy, step_masks)
                for _ in range(repeats):
                    nxt = device_picks(runner.forward(tokens, rows, picks.best), greedy, step_masks)
                    picks.read()
                    picks = nxt
                picks.read()
                row[f"ahead_ms_per_step_{label}"] = (time.perf_counter() - t) * 1e3 / (repeats + 1)
            out[f"decode x{batch}"] = {k: round(v, 3) for k, v in row.items()}
            print(f"decode x{batch}: {out[f'decode x{batch}']}", flush=True)
        finally:
            on_engine(runtime, partial(release, runs))
    return out


def breakdown(runtime: Runtime, context: int, batches: list[int], long_chunk: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    runner = runtime.engine.runner
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    graphs = runner.graphs
    cases: list[tuple[str, int, int, int, bool]] = []  # name, decode rows, chunk tokens, context, graphed
    for batch in batches:
        if graphs is not None:
            cases.append((f"decode x{batch} graph", batch, 0, context, True))
        cases.append((f"decode x{batch} eager", batch, 0, context, False))
    if graphs is not None:
        cases.append(("chunk 32 over context, graph (a hit's suffix)", 0, 32, context, True))
    cases.append(("chunk 32 over context, eager", 0, 32, context, False))
    cases.append((f"chunk {long_chunk} eager (a cold group's)", 0, long_chunk, 0, False))
    out: dict[str, Any] = {}
    for name, decode, chunk, keys, graphed in cases:
        rows, runs = on_engine(runtime, partial(rows_for, runner, decode + (1 if chunk else 0), keys, max(chunk, 1)))
        try:
            tokens = [[0]] * decode + ([[0] * chunk] if chunk else [])
            runner.graphs = graphs if graphed else None
            steps = 5 if graphed else 2
            for _ in range(2):
                runner.forward(tokens, rows)
            sync()
            replays = sum(graphs.replays.values()) if graphs is not None else 0
            t = time.perf_counter()
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    runner.forward(tokens, rows)
                sync()
            wall_ms = (time.perf_counter() - t) * 1e3 / steps
            table = kernel_table(prof, steps)
            table["wall_ms_per_step_profiled"] = round(wall_ms, 2)
            # a step too big for every captured graph runs eagerly though asked to replay
            table["graph_replays_per_step"] = (sum(graphs.replays.values()) - replays) / steps if graphs else 0
            if CUDA:
                table["device_idle_us_per_step"] = round(wall_ms * 1e3 - table["total_us_per_step"], 1)
            if decode and not chunk and runner.model.config is not None:
                layers = getattr(runner.model.config, "num_hidden_layers", 0) or 0
                if layers:
                    table["kernels_per_layer"] = round(table["kernels_total_per_step"] / layers, 1)
            out[name] = table
            print(f"{name}: {json.dumps({k: v for k, v in table.items() if k != 'top'})}", flush=True)
            for entry in table["top"][:8]:
                print(f"    {entry['us']:8.1f} us  x{entry['n']:<4} {entry['kernel']}", flush=True)
        finally:
            runner.graphs = graphs
            on_engine(runtime, partial(release, runs))
    return out


def stream_times(runtime: Runtime, tools_count: int, max_tokens: int) -> dict[str, Any]:
    tools = json.loads((WORKLOADS / "merchant_100_tools.json").read_text())[:tools_count]
    engine = runtime.engine

    def body(choice: str) -> dict[str, Any]:
        return {"messages": [{"role": "system", "content": "You are a merchant assistant."},
                             {"role": "user", "content": "Write a long report on last week's sales."}],
                "tools": tools, "tool_choice": choice, "temperature": 0, "max_tokens": max_tokens}

    async def one(request: dict[str, Any]) -> dict[str, Any]:
        prepared = runtime.service.prepare(ChatCompletionRequest.model_validate(request))
        sent = time.perf_counter()
        first: float | None = None
        prefilled: Prefilled | None = None
        finished: Finished | None = None
        stamps: list[tuple[float, int]] = []  # (when, tokens generated so far)
        forced, constrained = engine.forced_tokens, engine.constrained_tokens
        async for event in runtime.service.events(prepared):
            now = time.perf_counter()
            if isinstance(event, Prefilled):
                first, prefilled = now, event
            elif isinstance(event, TextDelta):
                stamps.append((now, event.tokens))
            elif isinstance(event, Finished):
                finished = event
                stamps.append((now, event.completion_tokens))
        spread = [(t, n) for t, n in stamps if n > 0]
        per_token = None
        if len(spread) >= 2 and spread[-1][1] > spread[0][1]:
            per_token = (spread[-1][0] - spread[0][0]) * 1e3 / (spread[-1][1] - spread[0][1])
        return {"ttft_ms": round(((first or sent) - sent) * 1e3, 1),
                "cache": prefilled.result if prefilled else None,
                "prompt_tokens": prefilled.prompt_tokens if prefilled else None,
                "tokens": finished.completion_tokens if finished else None,
                "finish": finished.finish_reason if finished else None,
                "ms_per_token": round(per_token, 2) if per_token is not None else None,
                "forced_tokens": engine.forced_tokens - forced,
                "constrained_tokens": engine.constrained_tokens - constrained}

    out: dict[str, Any] = {}
    out["first (the group's miss)"] = asyncio.run(one(body("none")))
    overlap, chunk_forced = engine.overlap, engine.chunk_forced
    settings = (("tool_choice none, launched ahead", "none", True, True),
                ("tool_choice none, read each step", "none", False, True),
                ("tool_choice auto, launched ahead", "auto", True, True),
                ("tool_choice auto, read each step", "auto", False, True),
                ("tool_choice required, forced tokens as one chunk", "required", True, True),
                ("tool_choice required, forced tokens one step each", "required", True, False))
    try:
        for label, choice, ahead, chunked in settings:
            engine.overlap = ahead and overlap
            engine.chunk_forced = chunked
            runs = [asyncio.run(one(body(choice))) for _ in range(2)]
            out[label] = runs[-1]
            print(f"{label}: {runs[-1]} (steps launched ahead so far {engine.ahead_steps})", flush=True)
    finally:
        engine.overlap, engine.chunk_forced = overlap, chunk_forced
    out["overlap_available"] = overlap
    return out


def numbers(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n.strip()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=3000, help="KV tokens each decode row reads (default 3000)")
    parser.add_argument("--batches", type=numbers, default=[1, 16, 32], help="decode batches (default 1,16,32)")
    parser.add_argument("--long-chunk", type=int, default=2048, help="the eager cold chunk's tokens (default 2048)")
    parser.add_argument("--repeats", type=int, default=30, help="timed steps per case in B (default 30)")
    parser.add_argument("--tools", type=int, default=20, help="tools in D's requests (default 20)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per stream in D (default 128)")
    parser.add_argument("--parts", default="ABCD")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "probe.json"))
    args = parser.parse_args(argv)
    probe = Probe(Path(args.out))
    started = time.perf_counter()
    settings = load_settings(overrides={"model": args.model, "disk_budget_bytes": 0}, environ=os.environ)
    runtime = build_runtime(settings, Metrics())
    probe.results["cuda"] = CUDA
    probe.results["start_s"] = round(time.perf_counter() - started, 1)
    print(f"runtime ready in {probe.results['start_s']}s (CUDA {CUDA})", flush=True)
    try:
        # B and C run the runner on this thread while the engine's waits for work (nothing is
        # submitted until D); the profiler wants the main thread.
        if "A" in args.parts:
            probe.part("engine", lambda: engine_info(runtime))
        if "B" in args.parts:
            probe.part("device_times", lambda: device_times(runtime, args.context, args.batches, args.repeats))
        if "C" in args.parts:
            probe.part("breakdown", lambda: breakdown(runtime, args.context, args.batches, args.long_chunk))
        if "D" in args.parts:
            probe.part("stream", lambda: stream_times(runtime, args.tools, args.max_tokens))
        graphs = runtime.engine.runner.graphs
        probe.results["graph_replays_total"] = dict(graphs.replays) if graphs is not None else None
    finally:
        runtime.engine.stop()
        probe.write()
        print(f"wrote {args.out}", flush=True)
    return probe.results


if __name__ == "__main__":
    main()
