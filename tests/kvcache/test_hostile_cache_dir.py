"""A gateway restarted on a cache dir someone with write access tampered with: a FIFO named like
an entry, an entry whose KV is NaN under a valid checksum, a corrupt file that can be neither moved
nor deleted, and temp files of a dead and of a live writer. Every request is a 200 with the output
of the first run; every fault is counted; no path reaches a client."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gateway.kvcache.disk_format import Header
from gateway.kvcache.entry_file import create_locked
from tests.kvcache import test_restart
from tests.kvcache.test_restart import (
    GROUPS,
    FirstRun,
    _cached_tokens,
    _copy_cache,
    _message,
    chat_body,
    gateway_process,
)

# The restart tests' module fixtures (a first run's cache dir and outputs: one run per process).
first_run, model_dir = test_restart.first_run, test_restart.model_dir


def _poison(path: Path) -> None:
    """Rewrite the entry with NaN tensors and a header signed over them, as anyone who can
    write the dir could."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
        names = list(handle.keys())
        tensors = {name: torch.full_like(handle.get_tensor(name), float("nan")) for name in names}
    header = Header.from_metadata(metadata)
    signed = header.signed(tensors[name] for name in header.tensor_names)
    save_file(tensors, str(path), metadata=signed.to_metadata())


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))


@dataclass(frozen=True)
class Tampered:
    cache_dir: Path
    files: dict[str, Path]  # by group
    responses: list[httpx.Response]  # each group twice, in GROUPS order
    metrics: str
    live_temp: Path


@pytest.fixture(scope="module")
def tampered(first_run: FirstRun, model_dir: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tampered]:
    work = tmp_path_factory.mktemp("tampered")
    cache_dir = _copy_cache(first_run, work / "cache")
    files = {group: first_run.entry_file(cache_dir, group) for group in GROUPS}
    files["intact"].unlink()
    os.mkfifo(files["intact"])
    _poison(files["flipped"])
    _corrupt(files["truncated"])
    if subprocess.run(["chattr", "+i", str(files["truncated"])], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    dead_temp, live_temp = cache_dir / "kv" / ".tmpQx7Zp0", cache_dir / "kv" / ".tmp-toolkv-live"
    dead_temp.write_bytes(b"\0" * 4096)  # what safetensors' save_file left when its writer was killed
    fd = create_locked(live_temp)  # a writer in another process, still writing
    hour_ago = time.time() - 3600
    for temp in (dead_temp, live_temp):
        os.utime(temp, (hour_ago, hour_ago))
    try:
        with gateway_process(model_dir, cache_dir, work / "gateway.log") as gateway:
            responses = [httpx.post(gateway.base_url + "/v1/chat/completions", json=chat_body(group), timeout=60)
                         for group in GROUPS for _ in range(2)]
            yield Tampered(cache_dir, files, responses, gateway.metrics(), live_temp)
    finally:
        os.close(fd)
        subprocess.run(["chattr", "-i", str(files["truncated"])], check=False)


def _by_group(tampered: Tampered) -> dict[str, list[httpx.Response]]:
    return {group: tampered.responses[2 * i : 2 * i + 2] for i, group in enumerate(GROUPS)}


def test_every_request_on_a_tampered_cache_dir_is_a_200_with_the_first_runs_output(
        first_run: FirstRun, tampered: Tampered) -> None:
    for group, (first, second) in _by_group(tampered).items():
        assert (first.status_code, second.status_code) == (200, 200), first.text
        # recomputed: its file was not used (a prefix may come from another group in RAM)
        assert _cached_tokens(first.json()) < first_run.entries[group]["prefix_tokens"]
        for response in (first, second):
            assert _message(response.json()) == _message(first_run.completions[group])
    assert not any(str(tampered.cache_dir) in r.text for r in tampered.responses)


def test_a_fifo_named_like_an_entry_never_freezes_the_gateway(tampered: Tampered) -> None:
    assert 'toolkv_cache_errors_total{kind="special"} 1.0' in tampered.metrics
    moved = [p.name.split(".")[1] for p in (tampered.cache_dir / "quarantine").iterdir()]
    assert "special" in moved


def test_an_entry_with_nan_kv_is_dropped_and_recomputed(tampered: Tampered) -> None:
    """Its checksum is valid (whoever wrote it could sign it): the logits give it away."""
    assert 'toolkv_cache_errors_total{kind="nonfinite"} 1.0' in tampered.metrics
    moved = [p.name.split(".")[1] for p in (tampered.cache_dir / "quarantine").iterdir()]
    assert "nonfinite" in moved


def test_a_bad_file_that_cannot_be_moved_never_fails_a_request(tampered: Tampered) -> None:
    assert 'toolkv_cache_errors_total{kind="checksum"} 1.0' in tampered.metrics
    assert tampered.files["truncated"].is_file()  # immutable: still there, skipped


def test_a_dead_writers_temp_is_swept_and_a_live_writers_is_kept(tampered: Tampered) -> None:
    temps = sorted(p.name for p in (tampered.cache_dir / "kv").iterdir() if p.name.startswith(".tmp"))
    assert temps == [tampered.live_temp.name]

