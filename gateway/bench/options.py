"""The `toolkv bench` command line, the lab's options (`--lab`) in a group of their own. Only argparse
here: the bench's own dependencies (httpx, rich, matplotlib: the `bench` extra) are imported when
the command runs, so `toolkv serve` never needs them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from gateway.bench.names import LAB_SCENARIO_NAMES, QUICK_RUN, QUICK_SCENARIOS, SCENARIO_NAMES
from gateway.bench.trajectories import DEFAULT_TRAJECTORIES_FILE, DEFAULT_TRAJECTORY_TOOLS_FILE
from gateway.bench.workload import DEFAULT_TOOLS_FILE


def register(sub: Any) -> None:
    """Add the `bench` subcommand to the CLI's subparsers."""
    p = sub.add_parser("bench", help="measure TTFT, latency and cache hits through the HTTP API",
                       description="Measure an OpenAI-compatible server (toolkv or a peer) with streaming "
                                   "requests. Scenarios: " + ", ".join(SCENARIO_NAMES) + "; with --lab also "
                                   + ", ".join(LAB_SCENARIO_NAMES) + ".")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="the server to measure, e.g. http://127.0.0.1:8000")
    target.add_argument("--spawn", action="store_true",
                        help="start `toolkv serve` on a fresh cache dir and stop it at the end (the restart "
                             "scenario needs this)")
    p.add_argument("--replicas", type=int, metavar="N",
                   help="with --spawn: start `toolkv serve --replicas N` (a fleet on Ray Serve; the ray extra)")
    lab = p.add_argument_group("lab", "toolkv's own acceptance runs: `--lab`, then any of these")
    lab.add_argument("--lab", action="store_true",
                     help="the lab: also the scenarios " + ", ".join(LAB_SCENARIO_NAMES) + " (each when named), the "
                          "in-process floor, and toolkv's own performance targets in the report")
    lab.add_argument("--check", action="store_true",
                     help="the lab (--lab implied), the run checked against toolkv's own performance targets (set "
                          "on its development machine with the default model): one line each, exit status 1 when "
                          "one is missed")
    lab.add_argument("--baseline-url",
                   help="fleet scenario: a second running fleet, routed round robin with a cache per replica "
                        "(`toolkv serve --replicas 2 --upstream-routing round_robin --replica-cache separate`), "
                        "for the baseline; with --spawn the bench starts one itself")
    p.add_argument("--model", help="the model id to request (default: the first of GET /v1/models); "
                                    "with --spawn, also what the server loads")
    p.add_argument("--peer-url",
                   help="another OpenAI-compatible server (e.g. llama.cpp's llama-server) to measure side by side: "
                        "the peer scenario sends every request to both, in turns (runs alone unless --scenario "
                        "names others)")
    p.add_argument("--peer-model", help="the model id to request from the peer (default: the first of its "
                                         "GET /v1/models, else --model's)")
    p.add_argument("--peer-api-key", help="sent to the peer as a bearer token")
    p.add_argument("--scenario", nargs="+", choices=(*SCENARIO_NAMES, *LAB_SCENARIO_NAMES), metavar="NAME",
                   help=f"any of {', '.join(SCENARIO_NAMES)}, and with --lab {', '.join(LAB_SCENARIO_NAMES)} "
                        "(default: all but peer and the lab's, which run only when named; with --peer-url, peer "
                        f"alone; restart only with --spawn; with --quick: {' and '.join(QUICK_SCENARIOS)})")
    p.add_argument("--out", default="bench-results", help="directory for bench.json and the plots")
    p.add_argument("--tools-file", type=Path, default=DEFAULT_TOOLS_FILE, help="a JSON list of OpenAI tools")
    p.add_argument("--requests", type=int, help="hits on the main group of the single scenario (default 8)")
    p.add_argument("--tools", type=int, help="tools per group (default 20; 10 with --quick)")
    p.add_argument("--tool-counts", help="comma list for the toolcount scenario (default 5,10,20,50)")
    p.add_argument("--groups", type=int, help="tool groups in the interleaved scenario (default 3)")
    p.add_argument("--clients", help="comma list of streaming client counts for the concurrent scenario, "
                                     "each run on one group and on mixed groups (default 1,4,8; 1,4 with --quick), "
                                     "and for the peer scenario (default 1,4,16,32; 1,4 with --quick)")
    p.add_argument("--requests-per-client", type=int,
                   help="requests each concurrent client sends one after another (default 2; 1 with --quick)")
    p.add_argument("--mixed-groups", type=int,
                   help="groups the concurrent scenario's mixed-group cases spread over (default 4; 2 with --quick)")
    p.add_argument("--concurrent-max-tokens", type=int,
                   help="tokens to generate per concurrent request, for output tokens/s (default 32; 8 with --quick)")
    p.add_argument("--compile-tools", type=int,
                   help="tools in the group that compiles during the compile-overlap hits "
                        "(default 20, ~3,000 tokens; --tools with --quick)")
    p.add_argument("--conversations", type=int,
                   help="tau-bench conversations the agent scenario replays, in (task, trial) order "
                        "(default 1: task 0, trial 0)")
    p.add_argument("--agent-max-tokens", type=int, help="tokens to generate per agent turn (default 16)")
    p.add_argument("--trajectories", type=Path, default=DEFAULT_TRAJECTORIES_FILE,
                   help="the agent scenario's JSON lines, one agent step each: {task_id, trial, turn_index, messages}")
    p.add_argument("--trajectory-tools", type=Path, default=DEFAULT_TRAJECTORY_TOOLS_FILE,
                   help="a JSON list of OpenAI tools sent with every agent turn (default: tau-bench airline's)")
    lab.add_argument("--history-tokens", type=int,
                   help="prompt tokens the history scenario sends over all its conversations "
                        "(default 1,000,000; 100,000 with --quick)")
    lab.add_argument("--history-window", type=int,
                   help="conversations the history scenario keeps live at once, each turn to one of them at "
                        "random (default 16)")
    lab.add_argument("--history-turns", type=int,
                   help="turns per history conversation, each adding a user message of ~300 tokens (default 8)")
    lab.add_argument("--constrained-max-tokens", type=int,
                   help="max_tokens of the constrained scenario's requests; an answer it cuts is a failure "
                        "(default 512)")
    lab.add_argument("--bounded", action="store_true",
                   help="constrained scenario, for random-weight test models: bound every open string, list and "
                        "number of the schemas, one call per answer, no json_object rows")
    p.add_argument("--max-tokens", type=int, help="tokens to generate per request (default 8; 4 with --quick)")
    p.add_argument("--tool-choice", choices=("none", "auto"), default="auto",
                   help="auto (default, the product's path): every request has a grammar, and a call streams "
                        "once its name is known; none: the tools stay in the prompt, no grammar")
    p.add_argument("--tools-in-system", action="store_true",
                   help="write the tools into the system message instead of `tools` (for servers whose chat "
                        "template drops tools, e.g. llama.cpp's chatml): every server sees the same text")
    p.add_argument("--quick", action="store_true",
                   help="a short run: " + QUICK_RUN + "; with the default model, the server's start included, about "
                        "a minute on a quiet 2-core CPU and up to 7 on one busy with other work (the start and the "
                        "first compile take the most)")
    p.add_argument("--api-key", help="sent as a bearer token")
    p.add_argument("--config", help="settings file for --spawn and the floor (default: config/toolkv.toml)")
    p.add_argument("--cache-dir", help="with --spawn: the server's cache dir (default: a temporary one)")
    lab.add_argument("--floor-model", help="model to load in-process for the floor (default: the spawned "
                                         "model, or the configured one when the server serves it)")
    floor = lab.add_mutually_exclusive_group()
    floor.add_argument("--floor", action="store_true",
                       help="load the model in the bench's own process and time its floor (restore + suffix "
                            "prefill) even when the server runs on this machine: it then shares the CPU with the "
                            "server and is labelled unreliable (default: the lab measures it only for a server on "
                            "another machine)")
    floor.add_argument("--no-floor", action="store_true", help="never measure the in-process floor")
    p.add_argument("--json", action="store_true",
                   help="print the whole report as JSON on stdout (progress and messages go to stderr)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    args.lab = args.lab or args.check
    if not args.lab and (problem := _needs_lab(args)):
        print(f"toolkv bench: {problem} is part of the lab: add --lab (toolkv bench --lab ...)", file=sys.stderr)
        return 2
    try:
        # lazy: command needs the bench extra (httpx, rich, matplotlib); the CLI imports this module for every command
        from gateway.bench.command import run
        from gateway.bench.lab.command import run as run_lab
    except ImportError as exc:
        print(f"toolkv bench needs the bench extra ({exc.name} is missing): {install_hint()}", file=sys.stderr)
        return 2
    return run_lab(args) if args.lab else run(args)


def _needs_lab(args: argparse.Namespace) -> str | None:
    """What on the command line only the lab runs, if anything."""
    named = [n for n in args.scenario or () if n in LAB_SCENARIO_NAMES]
    if named:
        return f"the {named[0]} scenario"
    return "--floor" if args.floor else "--floor-model" if args.floor_model else None


def install_hint() -> str:
    """How to install the bench extra: into this checkout when toolkv runs from one, else by name."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "gateway").is_dir():
        return f'pip install -e ".[bench]" (in {root})'
    return 'pip install "toolkv[bench]"'
