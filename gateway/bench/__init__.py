"""`toolkv bench`: TTFT, latency and cache hit measurements through the real HTTP API.

workload, trajectories and history (what is sent) -> client (one timed streaming request) ->
scenarios (single, toolcount, interleaved, restart, concurrent, compile-overlap, soak, agent,
history) -> floor (the in-process limit) -> report, agent_report and history_report (numbers,
JSON, tables) and plots; command runs them, options is the command line.
"""

from gateway.bench.options import register

__all__ = ["register"]
