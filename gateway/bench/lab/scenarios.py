"""The lab's scenarios, added to the bench's own (scenarios.SCENARIOS) for `toolkv bench --lab`:
history (a million tokens of synthetic conversations through the KV pool, RSS every 10%: history.py),
constrained (BFCL-style forced calls and structured outputs: validity and the grammar's cost per
token: constrained.py), fleet (replicas behind one ingress: interleaved groups, a hot group against
balanced ones, a round-robin baseline: fleet.py) and hostile-soak (one key's requests alone, then
while another key sends a hostile mix: hostile.py). Each runs only when named."""

from __future__ import annotations

import argparse
from typing import Any

from gateway.bench.bfcl import ConstrainedRows
from gateway.bench.context import Context, Floors, Scenario, ScenarioResult
from gateway.bench.lab.baselines import baseline_for
from gateway.bench.lab.constrained import run_constrained
from gateway.bench.lab.constrained_report import constrained_lines, constrained_stats, constrained_table
from gateway.bench.lab.fleet import planned as fleet_planned
from gateway.bench.lab.fleet import run_fleet
from gateway.bench.lab.fleet_report import fleet_lines, fleet_stats, fleet_table
from gateway.bench.lab.history import expected_requests, run_history
from gateway.bench.lab.history_report import history_lines, history_plot, history_stats
from gateway.bench.lab.hostile import hostile_lines, run_hostile_soak
from gateway.bench.lab.hostile import planned as hostile_planned
from gateway.bench.lab.plan import LabPlan
from gateway.bench.names import LAB_SCENARIO_NAMES
from gateway.bench.scenarios import SCENARIOS


def _details_only(result: ScenarioResult, floors: Floors) -> dict[str, Any]:
    """Its numbers are in its details (hostile.py)."""
    return {}


def lab_scenarios(args: argparse.Namespace, plan: LabPlan, rows: ConstrainedRows | None) -> dict[str, Scenario]:
    """The bench's scenarios and the lab's, counted by `plan`; `rows`: the constrained scenario's, when it runs."""

    async def constrained(ctx: Context) -> ScenarioResult:
        if rows is None:
            return ScenarioResult("constrained", skipped="no rows loaded")
        return await run_constrained(ctx, rows, plan.constrained_max_tokens)

    async def fleet(ctx: Context) -> ScenarioResult:
        return await run_fleet(ctx, plan, baseline_for(args, ctx))

    lab = {s.name: s for s in (
        Scenario("history", lambda ctx: run_history(ctx, plan),
                 lambda p: expected_requests(plan.history_tokens, tools=plan.history_tools, turns=plan.history_turns,
                                             words=plan.history_words),
                 lambda r, f: history_stats(r.samples), lines=lambda s: history_lines(s["history"]),
                 plot=history_plot),
        Scenario("constrained", constrained, lambda p: rows.num_requests if rows is not None else 0,
                 lambda r, f: constrained_stats(r.samples, r.details),
                 table=lambda s: constrained_table(s["constrained"]),
                 lines=lambda s: constrained_lines(s["constrained"])),
        Scenario("fleet", fleet, lambda p: fleet_planned(plan), lambda r, f: fleet_stats(r.samples, r.details),
                 table=lambda s: fleet_table(s["fleet"]), lines=lambda s: fleet_lines(s["fleet"])),
        Scenario("hostile-soak", run_hostile_soak, hostile_planned, _details_only,
                 lines=lambda s: hostile_lines(s["hostile-soak"])),
    )}
    assert tuple(lab) == LAB_SCENARIO_NAMES  # the command line lists them without importing this module
    return {**SCENARIOS, **lab}
