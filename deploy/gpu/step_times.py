"""Time the engine's steps in-process, replayed from CUDA graphs and eagerly: what a GPU session
measures first (docs/engine.md, "Next on a GPU").

    python3 deploy/gpu/step_times.py /tmp/q3 [--context 3000] [--repeats 20] [--out step_times.json]

Settings come from `TOOLKV_*` as for `toolkv serve` (the KV pool: TOOLKV_RAM_BUDGET_BYTES). For
each step shape it prints the host time (until the forward returns: on CUDA, launches only) and
the wall time (until the device is done), median of `--repeats`: decode steps at batch 1 to 64,
a prompt chunk alone at 16 to 512 tokens, and decode rows beside a chunk (a request joining running
ones). Each row reads `--context` tokens of KV (zeros: the timings do not depend on the values).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from gateway.engine.model_runner import ModelRunner, RowKV
from gateway.metrics import Metrics
from gateway.serving.runtime import build_runtime
from gateway.settings import load_settings


def timed(runner: ModelRunner, tokens: list[list[int]], rows: list[RowKV], repeats: int) -> tuple[float, float]:
    """Median host and wall milliseconds of one forward."""
    cuda = runner.device.type == "cuda"
    host, wall = [], []
    for _ in range(repeats + 2):  # two unmeasured: allocator and kernels settle
        if cuda:
            torch.cuda.synchronize(runner.device)
        started = time.perf_counter()
        runner.forward(tokens, rows)
        launched = time.perf_counter()
        if cuda:
            torch.cuda.synchronize(runner.device)
        host.append((launched - started) * 1e3)
        wall.append((time.perf_counter() - started) * 1e3)
    return statistics.median(host[2:]), statistics.median(wall[2:])


def shapes(context: int) -> list[tuple[str, int, int]]:
    """(name, decode rows, chunk tokens)."""
    decode = [(f"decode x{b}", b, 0) for b in (1, 4, 16, 32, 64)]
    chunks = [(f"chunk {n}", 0, n) for n in (16, 64, 256, 512)]
    mixed = [(f"decode x{b} + chunk {n}", b, n) for b, n in ((4, 32), (16, 32), (16, 128), (32, 64), (63, 256))]
    return decode + chunks + mixed


def probe(runner: ModelRunner, context: int, repeats: int) -> list[dict[str, Any]]:
    results = []
    graphs = runner.graphs
    for name, decode, chunk in shapes(context):
        runs = [runner.pool.allocate(context + chunk + 1) for _ in range(decode + (1 if chunk else 0))]
        if any(run is None for run in runs):
            print(f"{name}: skipped, the KV pool is too small")
            continue
        rows = [RowKV(None, run, context, context) for run in runs if run is not None]
        tokens = [[0]] * decode + ([[0] * chunk] if chunk else [])
        try:
            row: dict[str, Any] = {"step": name}
            for mode, using in (("graph", graphs), ("eager", None)):
                if mode == "graph" and using is None:
                    continue
                runner.graphs = using
                row[f"{mode}_host_ms"], row[f"{mode}_wall_ms"] = timed(runner, tokens, rows, repeats)
            results.append(row)
            print("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else str(v) for k, v in row.items()), flush=True)
        finally:
            runner.graphs = graphs
            for run in runs:
                if run is not None:
                    run.release()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=3000, help="KV tokens each row reads (default 3000)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args()
    settings = load_settings(overrides={"model": args.model, "disk_budget_bytes": 0}, environ=os.environ)
    runtime = build_runtime(settings, Metrics())
    engine = runtime.engine
    try:
        runner = engine.runner
        print(f"device {runner.device}, backend {runner.backend}, batch invariant {runner.batch_invariant}, "
              f"graphs {runner.graphs is not None}, context {args.context}", flush=True)
        results = engine.call(lambda: probe(runner, args.context, args.repeats)).result()
    finally:
        engine.stop()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(runner.device), "context": args.context, "steps": results}, f, indent=1)


if __name__ == "__main__":
    main()
