"""`toolkv serve --replicas 2 --ray-address ADDR` joins a cluster an operator started with
`ray start --head`. In Ray 2.60 such a head has token authentication on whenever a token exists;
toolkv finds the token where Ray's own tools do (here `RAY_AUTH_TOKEN_PATH`, with `RAY_AUTH_MODE`
unset, as an operator's shell has it) and serves through the cluster.

The head gets its own `--temp-dir`, so `/tmp/ray/ray_current_cluster` (which a `ray.init()` with no
address follows) is never rewritten, and it runs `--block` as a child of this test: its process
tree is this cluster and no other (`ray stop` would kill every Ray process on the machine, other
sessions' included). The cluster is the test's scaffolding, so it is killed, tree and all, at once
(`ray start --block` on SIGTERM stops gracefully, ~30 s with Serve's detached controller and proxy
on it); toolkv's own stop is what a user meets, and gets SIGTERM. Whatever happens, the test ends
with none of them running."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.serve_ray.conftest import MODEL, REPLICAS, REPO
from tests.serve_ray.test_replicas import ask, client_for
from tests.support.server import free_port
from tests.support.waiting import wait_until

pytest.importorskip("ray.serve")
psutil = pytest.importorskip("psutil")

HEAD_START_S = 120.0
SERVE_START_S = 300.0
STOP_S = 60.0
DEFAULT_ADDRESS_FILE = Path("/tmp/ray/ray_current_cluster")  # what `ray start` writes without --temp-dir
RAY_ENV = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@dataclass(frozen=True)
class Head:
    address: str  # the GCS, as `ray start` prints it
    temp_dir: Path
    token_path: Path


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RAY_ENV and not k.startswith("TOOLKV_")}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def poll(condition: Callable[[], bool], deadline_s: float, alive: subprocess.Popen[bytes], log: Path) -> None:
    """Wait for `condition` (an observable state) while `alive` runs; fail with its log otherwise."""
    if not wait_until(lambda: condition() or alive.poll() is not None, deadline_s, interval_s=0.2) or not condition():
        tail = log.read_text(errors="replace")[-4000:]
        pytest.fail(f"{alive.args[:4]} {'exited' if alive.poll() is not None else 'timed out'}:\n{tail}")


def stop_tree(proc: subprocess.Popen[bytes], descendants: list[psutil.Process]) -> list[psutil.Process]:
    """SIGTERM `proc` (its own handler stops what it started), wait, then kill whatever of it and
    `descendants` is left; returns the processes still alive after that (none, normally)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_S)
    _, alive = psutil.wait_procs(descendants, timeout=STOP_S / 2)
    for leftover in alive:
        leftover.kill()
    _, alive = psutil.wait_procs(alive, timeout=STOP_S / 2)
    return list(alive)


def kill_tree(proc: subprocess.Popen[bytes], descendants: list[psutil.Process]) -> list[psutil.Process]:
    """SIGKILL `proc` and `descendants` at once; returns the processes still alive after (none, normally)."""
    for victim in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.kill()
    proc.kill()
    proc.wait(STOP_S)
    _, alive = psutil.wait_procs(descendants, timeout=STOP_S)
    return list(alive)


def descendants_of(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    try:
        return list(psutil.Process(proc.pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return []


@contextmanager
def ray_head() -> Iterator[Head]:
    """A `ray start --head` cluster (2 CPUs, token authentication on) in a temp dir of its own."""
    temp_dir = Path(tempfile.mkdtemp(prefix="tkv-ray-", dir="/tmp"))  # short: Ray puts sockets in it
    token_path = temp_dir / "auth_token"
    token_path.write_text(secrets.token_hex(32))
    token_path.chmod(0o600)
    address_file = temp_dir / "ray" / "ray_current_cluster"
    log = temp_dir / "head.log"
    args = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--num-cpus", "2",
            "--port", str(free_port()), "--temp-dir", str(temp_dir / "ray"), "--include-dashboard=false",
            "--disable-usage-stats", "--ray-client-server-port", str(free_port()),
            "--dashboard-agent-listen-port", str(free_port())]
    env = clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path))
    with log.open("wb") as out:
        head = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        poll(address_file.exists, HEAD_START_S, head, log)
        yield Head(address_file.read_text().strip(), temp_dir, token_path)
    finally:
        left = kill_tree(head, descendants_of(head))
        ours = address_file.read_text().strip() if address_file.exists() else None
        default_after = DEFAULT_ADDRESS_FILE.read_text().strip() if DEFAULT_ADDRESS_FILE.exists() else None
        wrote_default = ours is not None and default_after == ours
        if wrote_default:
            DEFAULT_ADDRESS_FILE.unlink()  # only ever ours: another session's address stays
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not left, f"processes of the test's Ray cluster still running: {left}"
    assert not wrote_default, "ray start --temp-dir rewrote /tmp/ray/ray_current_cluster"


@contextmanager
def toolkv_on(head: Head, model_dir: Path, cache_dir: Path) -> Iterator[str]:
    """`toolkv serve --replicas 2 --ray-address ...` joined to `head`; yields its base URL."""
    port = free_port()
    log = head.temp_dir / "toolkv.log"
    args = [sys.executable, "-m", "gateway.cli", "serve", "--replicas", str(REPLICAS), "--ray-address",
            head.address, "--host", "127.0.0.1", "--port", str(port), "--model", str(model_dir),
            "--cache-dir", str(cache_dir)]
    env = clean_env(RAY_AUTH_TOKEN_PATH=str(head.token_path), TOOLKV_MIN_PREFIX_TOKENS="8",
                    TOOLKV_SERVED_MODEL_NAME=MODEL, TOOLKV_MAX_QUEUE="16",
                    TOOLKV_RAM_BUDGET_BYTES=str(64 * 1024**2))
    base_url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        serving = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        poll(lambda: _health(base_url) == "ok", SERVE_START_S, serving, log)
        yield base_url
    finally:
        left = stop_tree(serving, descendants_of(serving))
    # It stops on SIGTERM (the app is deleted from the cluster, nothing is left running), but Ray's
    # own SIGTERM handler in a driver joined to a cluster (logging.cc, "*** SIGTERM received") may
    # abort the process as it does: exit 0 or -6 (SIGABRT), never a hang or a leftover process.
    assert serving.returncode in (0, -signal.SIGABRT), log.read_text(errors="replace")[-4000:]
    assert not left, f"processes of toolkv serve still running: {left}"


def _health(base_url: str) -> str | None:
    try:
        status: str = httpx.get(base_url + "/health", timeout=5).json().get("status")
    except (httpx.HTTPError, ValueError):
        return None
    return status


def test_serve_joins_a_ray_start_head_with_token_auth_and_answers(tiny_model_dir, tmp_path):
    with ray_head() as head, toolkv_on(head, tiny_model_dir("llama"), tmp_path / "cache") as base_url:
        health = httpx.get(base_url + "/health", timeout=30).json()
        assert [(r["name"], r["status"]) for r in health["replicas"]] == [("engine-0", "ok"), ("engine-1", "ok")]
        client = client_for(base_url)
        first = ask(client, "Joined shop assistant.", "hello")
        assert first.choices[0].message is not None and first.usage.prompt_tokens_details.cached_tokens == 0
        again = ask(client, "Joined shop assistant.", "hello again")
        assert again.usage.prompt_tokens_details.cached_tokens > 0  # routed to the replica holding its group
