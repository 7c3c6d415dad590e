"""Run `toolkv bench`: the scenarios over HTTP (with a progress bar on stderr); write bench.json, the
plots and report.html into --out and print the measurements (the table, or with --json the whole
report). The lab (`--lab`, lab/command.py) runs through here too, as a `Suite` that adds its
scenarios, its in-process floor and its targets; this module knows it only as a `Suite`."""

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
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from gateway.bench.client import BenchClient, ContextTooLong, Sample
from gateway.bench.context import Context, Floors, Peer, Plan, Scenario, ScenarioResult
from gateway.bench.html_report import write_html
from gateway.bench.memory import read_memory
from gateway.bench.names import ONLY_WHEN_NAMED, QUICK_SCENARIOS
from gateway.bench.plots import write_plots
from gateway.bench.report import build_report, print_table
from gateway.bench.scenarios import SCENARIOS
from gateway.bench.server import ServerFailed, SpawnedServer
from gateway.bench.server_settings import engine_of, server_settings
from gateway.bench.trajectories import Trajectories, load_trajectories
from gateway.bench.workload import Workload, WorkloadError, load_tools

Env = dict[str, str]
PIPED_WIDTH = 1000  # a table written to a pipe or a file is never cut to 80 columns


class Suite(Protocol):
    """What a run measures beyond the requests: the bench's own (`UserSuite`: nothing) or the lab's."""

    @property
    def scenarios(self) -> Mapping[str, Scenario]: ...

    def spawn_env(self, args: argparse.Namespace, names: list[str], plan: Plan) -> tuple[Env, Env]:
        """Settings a spawned server gets: (reported in the JSON's meta, kept out of it)."""

    async def after(self, args: argparse.Namespace, served: str | None, plan: Plan, results: list[ScenarioResult],
                    client: BenchClient, workload: Workload, console: Console) -> Floors:
        """Run after the scenarios, the server still up; the floor per group size it measured."""

    def finish(self, report: dict[str, Any]) -> tuple[list[str], int]:
        """Add its parts to the report; the lines to print after the measurements, and the exit status."""


class UserSuite:
    """The bench as a user runs it: its scenarios, nothing after them, exit status 0."""

    scenarios: Mapping[str, Scenario] = SCENARIOS

    def spawn_env(self, args: argparse.Namespace, names: list[str], plan: Plan) -> tuple[Env, Env]:
        return {}, {}

    async def after(self, args: argparse.Namespace, served: str | None, plan: Plan, results: list[ScenarioResult],
                    client: BenchClient, workload: Workload, console: Console) -> Floors:
        return {}

    def finish(self, report: dict[str, Any]) -> tuple[list[str], int]:
        return [], 0


def run(args: argparse.Namespace, suite: Suite | None = None) -> int:
    suite = suite or UserSuite()
    progress_console = Console(stderr=True)
    console = progress_console if args.json else _stdout_console()
    names = scenario_names(args, suite.scenarios)
    try:
        plan, catalog = _plan(args), load_tools(args.tools_file)
        trajectories = (load_trajectories(args.trajectories, args.trajectory_tools, plan.conversations)
                        if "agent" in names else None)
    except (WorkloadError, ValueError) as exc:
        progress_console.print(f"toolkv bench: {exc}")
        return 2
    if trajectories is not None:
        plan = dataclasses.replace(plan, agent_turns=trajectories.num_turns)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache_dir, own_cache = _cache_dir(args)
    started = time.perf_counter()
    try:
        results, floors, meta = asyncio.run(
            _run_http(args, (names, suite), plan, catalog, trajectories, out_dir, cache_dir, progress_console))
    except ServerFailed as exc:
        progress_console.print(f"toolkv bench: {exc}")
        return 1
    finally:
        if own_cache and cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)
    meta["duration_s"] = round(time.perf_counter() - started, 1)
    report = build_report(meta, results, suite.scenarios, floors)
    lines, status = suite.finish(report)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2))
    written = [out_dir / "bench.json", *write_plots(report, out_dir, suite.scenarios)]
    written.append(write_html(report, written[1:], out_dir / "report.html", suite.scenarios))
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        print_table(report, suite.scenarios, console)
    for line in lines:
        console.print(line, soft_wrap=True, highlight=False)
    progress_console.print("wrote " + ", ".join(str(p) for p in written), soft_wrap=True, highlight=False)
    return status


def _stdout_console() -> Console:
    """The measurements' console: a terminal's width, or when piped wide enough for every table."""
    return Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)


def scenario_names(args: argparse.Namespace, registry: Mapping[str, Scenario]) -> list[str]:
    """--scenario's, else the default run's; with --peer-url the peer scenario too (alone by default)."""
    if args.peer_url:
        return [n for n in args.scenario or () if n != "peer"] + ["peer"]
    return list(args.scenario or default_scenarios(args, registry))


def default_scenarios(args: argparse.Namespace, registry: Mapping[str, Scenario]) -> list[str]:
    if args.quick:
        return list(QUICK_SCENARIOS)
    return [n for n in registry if (n != "restart" or args.spawn) and n not in ONLY_WHEN_NAMED]


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
                                                 ("agent_max_tokens", args.agent_max_tokens))
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
           plan.agent_max_tokens) < 1:
        raise ValueError("--tools, --requests, --groups, --clients, --tool-counts, --requests-per-client, "
                         "--mixed-groups, --concurrent-max-tokens, --compile-tools, --conversations and "
                         "--agent-max-tokens must be at least 1")
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


async def _run_http(args: argparse.Namespace, what: tuple[list[str], Suite], plan: Plan,
                    catalog: list[dict[str, Any]], trajectories: Trajectories | None, out_dir: Path,
                    cache_dir: Path | None, console: Console) -> tuple[list[ScenarioResult], Floors, dict[str, Any]]:
    names, suite = what
    spawn_env, secret_env = suite.spawn_env(args, names, plan) if cache_dir is not None else ({}, {})
    server = SpawnedServer(cache_dir=cache_dir, log_path=out_dir / "server.log", model=args.model, config=args.config,
                           replicas=args.replicas, env={**spawn_env, **secret_env}) if cache_dir is not None else None
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
        peer = await _peer(args, client, model) if "peer" in names else None
        try:
            results = await _run_scenarios(names, suite.scenarios, client, workload, plan, trajectories, server,
                                           peer, console)
        finally:
            if peer is not None:
                await peer.client.aclose()
        memory = await read_memory(client)
        floors = await suite.after(args, served, plan, results, client, workload, console)
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
    return results, floors, meta


async def _peer(args: argparse.Namespace, client: BenchClient, model: str | None) -> Peer:
    """The peer's client, and the model id to ask it for: --peer-model, else the first it lists, else
    the main server's."""
    peer = BenchClient(args.peer_url, args.peer_api_key, client.timeout_s, client.clock_zero)
    return Peer(peer, args.peer_model or await peer.served_model() or model)


async def _run_scenarios(names: list[str], registry: Mapping[str, Scenario], client: BenchClient,
                         workload: Workload, plan: Plan, trajectories: Trajectories | None,
                         server: SpawnedServer | None, peer: Peer | None, console: Console) -> list[ScenarioResult]:
    total = sum(registry[n].planned(plan) for n in names)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("starting", total=total)

        def on_sample(s: Sample) -> None:
            ttft = "-" if s.ttft_s is None else f"{s.ttft_s * 1000:.0f} ms"
            progress.update(task, advance=1, description=f"{s.scenario:<15} last: {s.cache:<6} {ttft:>9}")

        ctx = Context(client, workload, plan, server, on_sample, lambda n: progress.update(task, advance=n),
                      trajectories, peer=peer)
        results, done = [], 0
        for name in names:
            progress.update(task, description=f"{name:<15}")
            try:
                results.append(await registry[name].run(ctx))
            except ContextTooLong as exc:
                results.append(ScenarioResult(name, skipped=f"the prompt exceeds the model's context: {exc}"))
            done += registry[name].planned(plan)
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
