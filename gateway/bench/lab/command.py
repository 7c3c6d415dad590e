"""`toolkv bench --lab`: the bench's run (command.run) with the lab's `Suite`: its scenarios
(lab/scenarios.py) nameable beside the bench's, small memory bounds and two keys for a spawned
server when hostile-soak runs, the in-process floor after the scenarios, and every target of
lab/targets.py in the report; with --check each one checked: a line each, exit status 1 when one
is missed."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Mapping
from typing import Any

from rich.console import Console

from gateway.bench.bfcl import ConstrainedRows, RowsError
from gateway.bench.client import BenchClient
from gateway.bench.command import run as run_bench
from gateway.bench.context import Floors, Plan, Scenario, ScenarioResult
from gateway.bench.lab.constrained import load_rows
from gateway.bench.lab.floor import (
    FLOOR_DISABLED,
    FLOOR_LOCAL,
    FLOOR_QUICK,
    FloorProbe,
    FloorResult,
    measure_floor,
    server_is_local,
)
from gateway.bench.lab.floor_report import FLOOR_SHARES_CPU, floor_dict, floor_lines
from gateway.bench.lab.hostile import spawn_bounds as hostile_spawn_bounds
from gateway.bench.lab.hostile import spawn_env as hostile_spawn_env
from gateway.bench.lab.plan import LabPlan
from gateway.bench.lab.scenarios import lab_scenarios
from gateway.bench.lab.targets import check_lines, checks, targets
from gateway.bench.workload import Workload
from gateway.settings import DEFAULT_CONFIG, load_settings

FLOOR_QUESTIONS = 5


def run(args: argparse.Namespace) -> int:
    """The lab's run; 2 when the constrained scenario's rows cannot be loaded."""
    names = args.scenario or ()
    try:
        rows = load_rows(quick_set=args.quick, bounded=args.bounded) if "constrained" in names else None
    except RowsError as exc:
        Console(stderr=True).print(f"toolkv bench: {exc}")
        return 2
    try:
        plan = LabPlan.of(args)
    except ValueError as exc:
        Console(stderr=True).print(f"toolkv bench: {exc}")
        return 2
    return run_bench(args, LabSuite(args, plan, rows))


class LabSuite:
    """The lab as command.run sees it (command.Suite)."""

    def __init__(self, args: argparse.Namespace, plan: LabPlan, rows: ConstrainedRows | None) -> None:
        self.plan = plan
        self.scenarios: Mapping[str, Scenario] = lab_scenarios(args, plan, rows)
        self.check = bool(args.check)
        self.floors: dict[int, FloorResult] = {}
        self.floor_skipped: str | None = None
        self.shares_cpu = False

    def spawn_env(self, args: argparse.Namespace, names: list[str], plan: Plan) -> tuple[dict[str, str],
                                                                                          dict[str, str]]:
        return _spawn_env(args, names, self.plan), _hostile_keys(args, names)

    async def after(self, args: argparse.Namespace, served: str | None, plan: Plan, results: list[ScenarioResult],
                    client: BenchClient, workload: Workload, console: Console) -> Floors:
        """The floor; it stands in for the server's own timing only when it did not share its CPU."""
        self.floors, self.floor_skipped, self.shares_cpu = await measure_floors(
            args, served, plan, results, client, workload, console)
        return self.probe_floors()

    def probe_floors(self) -> Floors:
        """The floor per group size for the report's blocks: none when it shared the server's CPU."""
        return {} if self.shares_cpu else {n: f.floor_ms for n, f in self.floors.items()}

    def finish(self, report: dict[str, Any]) -> tuple[list[str], int]:
        """The floor and the targets into the report, with --check the checks too: then the check
        lines and the exit status. A floor measured beside the server (`--floor`) is kept, labelled
        unreliable."""
        shares_cpu = self.shares_cpu and bool(self.floors)
        report["floor"] = {"skipped": self.floor_skipped, "note": FLOOR_SHARES_CPU if shares_cpu else None,
                           "by_tools": {str(n): floor_dict(f, shares_cpu) for n, f in sorted(self.floors.items())}}
        report["lab_lines"] = floor_lines(report["floor"])
        report["targets"] = targets(report)
        if not self.check:
            return [], 0
        found = checks(report)
        report["checks"] = [c.to_dict() for c in found]
        return check_lines(found), 1 if any(c.result == "missed" for c in found) else 0


def _spawn_env(args: argparse.Namespace, names: list[str], plan: LabPlan) -> dict[str, str]:
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


async def measure_floors(args: argparse.Namespace, served: str | None, plan: Plan, results: list[ScenarioResult],
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
