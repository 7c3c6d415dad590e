"""The bench's default workload files, shipped in the package under gateway/bench/workloads/
(provenance and licenses in its README.md)."""

from __future__ import annotations

from pathlib import Path

WORKLOADS = Path(__file__).resolve().parent / "workloads"
MERCHANT_TOOLS = WORKLOADS / "merchant_100_tools.json"
RETAIL_TOOLS = WORKLOADS / "retail_16_tools.json"
MERCHANT_QUERIES = WORKLOADS / "contextcache" / "queries_openai.jsonl"
TAU_BENCH = WORKLOADS / "tau_bench"
AIRLINE_TOOLS = TAU_BENCH / "tools_airline.json"
AIRLINE_TRAJECTORIES = TAU_BENCH / "airline_trajectory_turns.head150.jsonl"
