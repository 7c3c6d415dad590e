"""`toolkv bench`: TTFT, latency and cache hit measurements through the real HTTP API.

workload, trajectories, history and bfcl (what is sent) -> client (one timed request) ->
scenarios (single, toolcount, interleaved, restart, concurrent, compile-overlap, soak, agent,
history; constrained in constrained.py, whose answers validity.py checks) -> floor (the in-process
limit) -> report, agent_report, history_report and constrained_report (numbers, JSON, tables) and
plots; command runs them, options is the command line.
"""

from gateway.bench.options import register

__all__ = ["register"]
