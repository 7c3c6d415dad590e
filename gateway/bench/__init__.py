"""`toolkv bench`: TTFT, latency and cache hit measurements through the real HTTP API.

workload and trajectories (what is sent) -> client (one timed streaming request) -> scenarios
(single, toolcount, interleaved, restart, concurrent, compile-overlap, soak, agent) -> floor (the
in-process limit) -> report and agent_report (numbers, JSON, tables) and plots; command runs them,
options is the command line.
"""

from gateway.bench.options import register

__all__ = ["register"]
