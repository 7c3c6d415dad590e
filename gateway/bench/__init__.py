"""`toolkv bench`: TTFT, latency and cache hit measurements through the real HTTP API.

workload, trajectories, history and bfcl (what is sent; the default files, shipped in workloads/,
are named in data) -> client (one timed request) -> context (plan, context and result of a
scenario) -> scenarios (the registry; single, toolcount, interleaved, restart, concurrent,
compile-overlap, soak), conversations (agent, history), constrained (whose answers validity.py
checks), fleet (which reads the ingress's /metrics with fleet_metrics.py), hostile and peer (toolkv
and another server side by side) -> floor (the in-process limit) -> report, concurrency_report,
floor_report, agent_report, history_report, constrained_report, fleet_report and peer_report
(numbers, JSON, tables; percentiles and ratios in stats; the server's memory in memory) and plots;
command runs them, server spawns `toolkv serve`, options is the command line (names: the
scenarios' names).
"""

from gateway.bench.options import register

__all__ = ["register"]
