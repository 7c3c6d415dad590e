"""The fleet scenario's baseline: a second fleet routed round robin with a cache per replica,
measured beside the fleet under test: one already running (`--baseline-url`), or with --spawn one
spawned in the main fleet's place for a while (`BaselineSwap`)."""

from __future__ import annotations

import argparse
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gateway.bench.client import BenchClient
from gateway.bench.context import Context
from gateway.bench.server import SpawnedServer


class BaselineFleet(Protocol):
    """A fleet routed round robin for the comparison: `start` gives its base URL, `stop` ends it."""

    @property
    def description(self) -> str: ...

    async def start(self) -> str: ...

    async def stop(self) -> None: ...


def baseline_for(args: argparse.Namespace, ctx: Context) -> BaselineFleet | None:
    """--baseline-url's fleet, else one spawned in the main one's place, else none."""
    if args.baseline_url:
        return FixedBaseline(args.baseline_url)
    if isinstance(ctx.server, SpawnedServer) and ctx.server.fleet:
        return BaselineSwap(ctx.server, ctx.client)
    return None


@dataclass(frozen=True, slots=True)
class FixedBaseline:
    """A baseline deployment already running (`--baseline-url`)."""

    url: str
    description: str = "the deployment at --baseline-url"

    async def start(self) -> str:
        return self.url

    async def stop(self) -> None:
        return None


class BaselineSwap:
    """The fleet scenario's baseline with `--spawn`: a second fleet routed round robin, each replica
    with a cache of its own (N independent servers behind a plain load balancer), on a fresh cache
    dir. It runs in the main server's place, never beside it (one fleet's cores or GPUs at a time):
    `start` stops the main server and starts the baseline; `stop` stops the baseline and starts the
    main server again on its cache dir, the bench's client rebased onto it."""

    ARGS = ("--upstream-routing", "round_robin", "--replica-cache", "separate")
    description = "round robin, a cache dir per replica (spawned in the main fleet's place)"

    def __init__(self, main: SpawnedServer, client: BenchClient) -> None:
        self.main = main
        self.client = client
        self.server: SpawnedServer | None = None

    async def start(self) -> str:
        await self.main.stop()
        main = self.main
        self.server = SpawnedServer(cache_dir=Path(tempfile.mkdtemp(prefix="toolkv-bench-baseline-")),
                                    log_path=main.log_path.with_name("baseline-server.log"), model=main.model,
                                    config=main.config, replicas=main.replicas,
                                    extra_args=(*main.extra_args, *self.ARGS), env=main.env)
        return await self.server.start()

    async def stop(self) -> None:
        server, self.server = self.server, None
        try:
            if server is not None:
                await server.stop()
                shutil.rmtree(server.cache_dir, ignore_errors=True)
        finally:
            self.client.rebase(await self.main.start())
