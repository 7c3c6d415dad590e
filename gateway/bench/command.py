"""Run `toolkv bench`: the scenarios over HTTP (with a progress bar on stderr), then, for a server on
another machine or with --floor, the floor in-process; write bench.json, the plots and report.html
into --out and print the measurements (the table, or with --json the whole report); with --check,
also the run against toolkv's own targets, which decide the exit status."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from gateway.bench.bfcl import ConstrainedRows, RowsError
from gateway.bench.client import BenchClient, ContextTooLong, Sample
from gateway.bench.context import BaselineFleet, Context, Peer, Plan, ScenarioResult
from gateway.bench.html_report import write_html
from gateway.bench.lab.constrained import load_rows
from gateway.bench.lab.fleet import FixedBaseline
from gateway.bench.lab.floor import (
    FLOOR_DISABLED,
    FLOOR_LOCAL,
    FLOOR_QUICK,
    FloorProbe,
    FloorResult,
    measure_floor,
    server_is_local,
)
from gateway.bench.lab.hostile import spawn_bounds as hostile_spawn_bounds
from gateway.bench.lab.hostile import spawn_env as hostile_spawn_env
from gateway.bench.lab.targets import check_lines, checks
from gateway.bench.memory import read_memory
from gateway.bench.names import ONLY_WHEN_NAMED, QUICK_SCENARIOS
from gateway.bench.plots import write_plots
from gateway.bench.report import build_report, print_table
from gateway.bench.scenarios import SCENARIOS
from gateway.bench.server import BaselineSwap, ServerFailed, SpawnedServer
from gateway.bench.server_settings import engine_of, server_settings
from gateway.bench.trajectories import Trajectories, load_trajectories
from gateway.bench.workload import Workload, WorkloadError, load_tools
from gateway.settings import DEFAULT_CONFIG, load_settings

FLOOR_QUESTIONS = 5


PIPED_WIDTH = 1000  # a table written to a pipe or a file is never cut to 80 columns


def run(args: argparse.Namespace) -> int:
    progress_console = Console(stderr=True)
    console = progress_console if args.json else _stdout_console()
    names = _scenario_names(args)
    try:
        plan, catalog = _plan(args), load_tools(args.tools_file)
        trajectories = (load_trajectories(args.trajectories, args.trajectory_tools, plan.conversations)
                        if "agent" in names else None)
        rows = load_rows(quick_set=args.quick, bounded=args.bounded) if "constrained" in names else None
    except (WorkloadError, RowsError, ValueError) as exc:
        progress_console.print(f"toolkv bench: {exc}")
        return 2
    if trajectories is not None:
        plan = dataclasses.replace(plan, agent_turns=trajectories.num_turns)
    if rows is not None:
        plan = dataclasses.replace(plan, constrained_requests=rows.num_requests)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache_dir, own_cache = _cache_dir(args)
    started = time.perf_counter()
    try:
        results, (floors, floor_skipped, shares_cpu), meta = asyncio.run(
            _run_http(args, names, plan, catalog, (trajectories, rows), out_dir, cache_dir, progress_console))
    except ServerFailed as exc:
        progress_console.print(f"toolkv bench: {exc}")
        return 1
    finally:
        if own_cache and cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)
    meta["duration_s"] = round(time.perf_counter() - started, 1)
    report = build_report(meta, results, floors, floor_skipped, shares_cpu)
    found = checks(report) if args.check else []
    if args.check:
        report["checks"] = [c.to_dict() for c in found]
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2))
    written = [out_dir / "bench.json", *write_plots(report, out_dir)]
    written.append(write_html(report, written[1:], out_dir / "report.html"))
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        print_table(report, console)
    for line in check_lines(found) if args.check else []:
        console.print(line, soft_wrap=True, highlight=False)
    progress_console.print("wrote " + ", ".join(str(p) for p in written), soft_wrap=True, highlight=False)
    return 1 if any(c.result == "missed" for c in found) else 0


def _stdout_console() -> Console:
    """The measurements' console: a terminal's width, or when piped wide enough for every table."""
    return Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)


def _scenario_names(args: argparse.Namespace) -> list[str]:
    """--scenario's, else the default run's; with --peer-url the peer scenario too (alone by default)."""
    if args.peer_url:
        return [n for n in args.scenario or () if n != "peer"] + ["peer"]
    return list(args.scenario or _default_scenarios(args))


def _default_scenarios(args: argparse.Namespace) -> list[str]:
    if args.quick:
        return list(QUICK_SCENARIOS)
    return [n for n in SCENARIOS if (n != "restart" or args.spawn) and n not in ONLY_WHEN_NAMED]


def _plan(args: argparse.Namespace) -> Plan:
    if args.replicas is not None and (not args.spawn or args.replicas < 1):
        raise ValueError("--replicas N takes --spawn and N >= 1 (against a running fleet, pass its --base-url)")
    plan = Plan.quick(args.tools or 10) if args.quick else Plan(tools=args.tools or 20)
    changes: dict[str, Any] = {k: v for k, v in (("requests", args.requests), ("groups", args.groups),
                                                 ("requests_per_client", args.requests_per_client),
                                                 ("mixed_groups", args.mixed_groups),
                                                 ("concurrent_max_tokens", args.concurrent_max_tokens),
                                                 ("compile_tools", args.compile_tools),
                                                 ("conversations", args.conversations),
                                                 ("agent_max_tokens", args.agent_max_tokens),
                                                 ("history_tokens", args.history_tokens),
                                                 ("history_window", args.history_window),
                                                 ("history_turns", args.history_turns),
                                                 ("constrained_max_tokens", args.constrained_max_tokens))
                                 if v is not None}
    if args.tool_counts:
        changes["tool_counts"] = _int_list("--tool-counts", args.tool_counts)
    if args.clients:
        changes["clients"] = changes["peer_clients"] = tuple(sorted(set(_int_list("--clients", args.clients))))
    plan = dataclasses.replace(plan, **changes)
    if args.peer_url is None and args.scenario and "peer" in args.scenario:
        raise ValueError("the peer scenario needs --peer-url: the other server to measure beside this one")
    if min(plan.tools, plan.requests, plan.groups, *plan.clients, *plan.tool_counts, plan.requests_per_client,
           plan.mixed_groups, plan.concurrent_max_tokens, plan.compile_tools, plan.conversations,
           plan.agent_max_tokens, plan.history_tokens, plan.history_window, plan.history_turns,
           plan.constrained_max_tokens) < 1:
        raise ValueError("--tools, --requests, --groups, --clients, --tool-counts, --requests-per-client, "
                         "--mixed-groups, --concurrent-max-tokens, --compile-tools, --conversations, "
                         "--agent-max-tokens, --history-tokens, --history-window, --history-turns and "
                         "--constrained-max-tokens must be at least 1")
    return plan


def _int_list(option: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise ValueError(f"{option} takes a comma list of whole numbers, e.g. 1,4,8 (got {text!r})") from None


def _cache_dir(args: argparse.Namespace) -> tuple[Path | None, bool]:
    """The spawned server's cache dir, and whether the bench made it (and so removes it)."""
    if not args.spawn:
        return None, False
    if args.cache_dir:
        return Path(args.cache_dir), False
    return Path(tempfile.mkdtemp(prefix="toolkv-bench-")), True


async def _run_http(args: argparse.Namespace, names: list[str], plan: Plan, catalog: list[dict[str, Any]],
                    loaded: tuple[Trajectories | None, ConstrainedRows | None], out_dir: Path, cache_dir: Path | None,
                    console: Console
                    ) -> tuple[list[ScenarioResult], tuple[dict[int, FloorResult], str | None, bool], dict[str, Any]]:
    spawn_env = _spawn_env(args, names, plan) if cache_dir is not None else {}
    keys_env = _hostile_keys(args, names) if cache_dir is not None else {}  # kept out of the report
    server = SpawnedServer(cache_dir=cache_dir, log_path=out_dir / "server.log", model=args.model, config=args.config,
                           replicas=args.replicas, env={**spawn_env, **keys_env}) if cache_dir is not None else None
    clock_zero = time.perf_counter()
    if server is not None:
        console.print(f"starting toolkv serve (log: {server.log_path}) ...")
    settings = asyncio.create_task(asyncio.to_thread(server_settings, args))  # beside the server's start
    base_url = await server.start() if server is not None else args.base_url
    client = BenchClient(base_url, args.api_key, args.timeout, clock_zero)
    try:
        served = await client.served_model()
        version = await client.get_json("/version")
        model = (args.model if not args.spawn else None) or served
        workload = Workload(catalog, uuid.uuid4().hex[:8], model=model,
                            max_tokens=args.max_tokens or (4 if args.quick else 8),
                            tool_choice=args.tool_choice, tools_in_system=args.tools_in_system)
        baseline = _baseline(args, server, client)
        peer = await _peer(args, client, model) if "peer" in names else None
        try:
            results = await _run_scenarios(names, client, workload, plan, loaded, server, (baseline, peer), console)
        finally:
            if peer is not None:
                await peer.client.aclose()
        memory = await read_memory(client)
        floor = await _floors(args, served, plan, results, client, workload, console)
    finally:
        await client.aclose()
        if server is not None:
            await server.stop()
    meta = _meta(args, plan, client.base_url, served, workload, spawn_env)
    meta["memory"] = memory
    if peer is not None:
        meta["options"].update(peer_url=peer.client.base_url, peer_model=peer.model)
    meta["settings"] = {**await settings, "model": served,
                        "server_version": version.get("version") if isinstance(version, dict) else None}
    meta["settings"].update(engine_of(version))
    return results, floor, meta


def _spawn_env(args: argparse.Namespace, names: list[str], plan: Plan) -> dict[str, str]:
    """Settings a spawned server gets for the scenarios named (reported in the JSON's meta): for
    the fleet scenario, its ingress spills a group's requests to the second replica once half the
    hot group's clients are in flight on the home; for hostile-soak, small memory bounds
    (`hostile.spawn_bounds`)."""
    env = hostile_spawn_bounds() if "hostile-soak" in names else {}
    if "fleet" in names and args.replicas and args.replicas >= 2:
        env["TOOLKV_UPSTREAM_MAX_IN_FLIGHT"] = str(max(1, plan.fleet_clients // 2))
    return env


def _hostile_keys(args: argparse.Namespace, names: list[str]) -> dict[str, str]:
    """hostile-soak on a spawned server: two keys, B (the bench's own, --api-key or one made up) and A."""
    if "hostile-soak" not in names:
        return {}
    args.api_key, env = hostile_spawn_env(args.api_key)
    return env


async def _peer(args: argparse.Namespace, client: BenchClient, model: str | None) -> Peer:
    """The peer's client, and the model id to ask it for: --peer-model, else the first it lists, else
    the main server's."""
    peer = BenchClient(args.peer_url, args.peer_api_key, client.timeout_s, client.clock_zero)
    return Peer(peer, args.peer_model or await peer.served_model() or model)


def _baseline(args: argparse.Namespace, server: SpawnedServer | None, client: BenchClient) -> BaselineFleet | None:
    """The fleet scenario's round-robin fleet: --baseline-url's, else one spawned in the main one's place."""
    if args.baseline_url:
        return FixedBaseline(args.baseline_url)
    if server is not None and server.fleet:
        return BaselineSwap(server, client)
    return None


async def _run_scenarios(names: list[str], client: BenchClient, workload: Workload, plan: Plan,
                         loaded: tuple[Trajectories | None, ConstrainedRows | None], server: SpawnedServer | None,
                         others: tuple[BaselineFleet | None, Peer | None], console: Console) -> list[ScenarioResult]:
    total = sum(SCENARIOS[n].planned(plan) for n in names)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("starting", total=total)

        def on_sample(s: Sample) -> None:
            ttft = "-" if s.ttft_s is None else f"{s.ttft_s * 1000:.0f} ms"
            progress.update(task, advance=1, description=f"{s.scenario:<15} last: {s.cache:<6} {ttft:>9}")

        ctx = Context(client, workload, plan, server, on_sample, lambda n: progress.update(task, advance=n), *loaded,
                      baseline=others[0], peer=others[1])
        results, done = [], 0
        for name in names:
            progress.update(task, description=f"{name:<15}")
            try:
                results.append(await SCENARIOS[name].run(ctx))
            except ContextTooLong as exc:
                results.append(ScenarioResult(name, skipped=f"the prompt exceeds the model's context: {exc}"))
            done += SCENARIOS[name].planned(plan)
            progress.update(task, completed=done)
    return results


def _meta(args: argparse.Namespace, plan: Plan, base_url: str, served: str | None, workload: Workload,
          spawn_env: dict[str, str]) -> dict[str, Any]:
    return {
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "toolkv " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else None,
        "base_url": base_url, "spawned": bool(args.spawn), "model": served, "run_id": workload.run_id,
        "options": {**dataclasses.asdict(plan), "max_tokens": workload.max_tokens,
                    "tool_choice": workload.tool_choice, "tools_in_system": workload.tools_in_system,
                    "tools_file": str(args.tools_file), "quick": bool(args.quick), "replicas": args.replicas,
                    "baseline_url": args.baseline_url, "spawn_env": spawn_env,
                    "trajectories": str(args.trajectories), "trajectory_tools": str(args.trajectory_tools)},
        "host": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    }


async def _floors(args: argparse.Namespace, served: str | None, plan: Plan, results: list[ScenarioResult],
                  client: BenchClient, workload: Workload,
                  console: Console) -> tuple[dict[int, FloorResult], str | None, bool]:
    """The floor per group size, each timing paired with an HTTP hit, or why it was skipped; and
    whether it shared the CPU with the server. By default it runs only for a server on another
    machine: beside the server, the two slow each other down (once a floor of 4.9 s against a
    470 ms hit), so only `--floor` measures it there, labelled unreliable."""
    shares_cpu = bool(args.spawn) or server_is_local(args.base_url)
    if args.no_floor:
        return {}, FLOOR_DISABLED, shares_cpu
    if shares_cpu and not args.floor:
        return {}, FLOOR_LOCAL, shares_cpu
    if args.quick and not args.floor:
        return {}, FLOOR_QUICK, shares_cpu
    groups = _floor_groups(results, plan, args.quick)
    if not groups:
        return {}, "no hit on a group of the tool catalog to pair it with", shares_cpu
    probe = None
    try:
        settings = _floor_settings(args, served)
        if settings is None:
            return {}, "the server's model is not the configured one: pass --floor-model", shares_cpu
        with console.status(f"measuring the floor in-process ({settings.model}, groups {', '.join(groups)}) ..."):
            probe = await asyncio.to_thread(FloorProbe, settings)
            measured = [await measure_floor(probe, client, workload, workload.group(label, n),
                                            3 if args.quick else FLOOR_QUESTIONS) for label, n in groups.items()]
    except Exception as exc:
        return {}, f"{type(exc).__name__}: {exc}", shares_cpu
    finally:
        if probe is not None:
            probe.close()
    return {f.num_tools: f for f in measured}, None, shares_cpu


def _floor_settings(args: argparse.Namespace, served: str | None) -> Any:
    """Settings for the in-process model, or None when it would not be the server's model."""
    from gateway.engine.model_loader import resolve_source  # lazy: the engine package loads torch

    config = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    model = args.floor_model or (args.model if args.spawn else None)
    settings = load_settings(config, {"model": model})
    if model is None and not args.spawn and resolve_source(settings).served_name != served:
        return None
    return settings


def _floor_groups(results: list[ScenarioResult], plan: Plan, quick: bool) -> dict[str, int]:
    """One group per size that had hits on a group starting at tool 0: label -> tools."""
    by_size: dict[int, str] = {}
    for result in results:
        # Not the catalog's groups and questions; or (peer) half of them answered by another server.
        if result.name in ("agent", "history", "constrained", "fleet", "peer"):
            continue
        for s in result.samples:
            if s.cache == "hit" and s.tool_offset == 0 and s.num_tools not in by_size:
                by_size[s.num_tools] = s.group
    if quick:
        by_size = {n: label for n, label in by_size.items() if n == plan.tools}
    return {label: n for n, label in sorted(by_size.items())}
