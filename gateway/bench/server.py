"""A `toolkv serve` subprocess the bench starts, restarts (same cache dir) and stops (`--spawn`),
with `--replicas N` a fleet on Ray Serve."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import httpx

READY_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 60.0


class ServerFailed(RuntimeError):
    """The spawned server exited or reported a failed model load."""


class SpawnedServer:
    def __init__(self, *, cache_dir: Path, log_path: Path, model: str | None, config: str | None,
                 replicas: int | None = None, extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        self.cache_dir = cache_dir
        self.log_path = log_path
        self.model = model
        self.config = config
        self.replicas = replicas
        self.extra_args = tuple(extra_args)
        self.env = dict(env or {})  # TOOLKV_* settings beyond the caller's environment
        self.base_url = ""
        self._proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None

    async def start(self) -> str:
        """Start `toolkv serve` on a free port and wait until /health says the model is loaded."""
        port = _free_port()
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--cache-dir", str(self.cache_dir)]
        cmd += ["--model", self.model] if self.model else []
        cmd += ["--config", self.config] if self.config else []
        cmd += ["--replicas", str(self.replicas)] if self.replicas else []
        cmd += self.extra_args
        self._log = self.log_path.open("ab")
        self._proc = await asyncio.create_subprocess_exec(*cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                                          env={**os.environ, **self.env})
        self.base_url = f"http://127.0.0.1:{port}"
        try:
            await self._wait_ready()
        except BaseException:  # a start that failed (or was interrupted) leaves nothing running
            await self.stop()
            raise
        return self.base_url

    @property
    def fleet(self) -> bool:
        """Replicas behind an ingress (a replica that fails to load stops `toolkv serve` itself)."""
        return bool(self.replicas and self.replicas > 1)

    async def stop(self) -> None:
        """SIGTERM, so the server shuts down cleanly and finishes its disk writes."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    async def restart(self) -> str:
        await self.stop()
        return await self.start()

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        async with httpx.AsyncClient(timeout=5.0) as http:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.returncode is not None:
                    raise ServerFailed(f"the server exited during start-up; see {self.log_path}")
                status = await _health(http, self.base_url)
                if status == "ok":
                    return
                if status == "failed" and not self.fleet:  # a fleet's ingress says so until its replicas run
                    raise ServerFailed(f"the server failed to load its model; see {self.log_path}")
                await asyncio.sleep(0.2)  # polling readiness, not synchronising
        raise ServerFailed(f"the server was not ready after {READY_TIMEOUT_S:.0f}s; see {self.log_path}")


async def _health(http: httpx.AsyncClient, base_url: str) -> str | None:
    try:
        return str((await http.get(base_url + "/health")).json().get("status"))
    except (httpx.HTTPError, ValueError):
        return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
