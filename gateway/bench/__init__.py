"""`toolkv bench`: TTFT, latency and cache hit measurements through the real HTTP API.

workload, trajectories, history and bfcl (what is sent) -> client (one timed request) ->
scenarios (single, toolcount, interleaved, restart, concurrent, compile-overlap, soak, agent,
history; constrained in constrained.py, whose answers validity.py checks; fleet in fleet.py, which
reads the ingress's /metrics with fleet_metrics.py) -> floor (the in-process limit) -> report,
agent_report, history_report, constrained_report and fleet_report (numbers, JSON, tables) and
plots; command runs them, server spawns `toolkv serve`, options is the command line.
"""

from gateway.bench.options import register

__all__ = ["register"]
