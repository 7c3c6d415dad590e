"""`toolkv bench`: TTFT, latency and cache hit measurements through the real HTTP API, as a user
runs them.

workload, trajectories and bfcl (what is sent; the default files, shipped in workloads/, are named
in data) -> client (one timed request) -> context (what a scenario is, is given and gives back) ->
scenarios (the registry: single, toolcount, interleaved, restart, concurrent, compile-overlap,
soak), conversations (agent) and peer (toolkv and another server side by side) -> report (numbers,
JSON, tables through each scenario's hooks), concurrency_report, agent_report and peer_report
(percentiles and ratios in stats; the server's memory in memory; forced tokens in forced) and
plots, html_report; command runs them (server spawns `toolkv serve`), options is the command line
(names: the scenarios' names).

The lab (lab/, `toolkv bench --lab`) is toolkv's own acceptance runs, built on this package and
never imported by it but to dispatch `--lab`: its scenarios, the in-process floor, every target.
"""

from gateway.bench.options import register

__all__ = ["register"]
