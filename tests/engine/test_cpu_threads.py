"""torch's CPU threads are what the machine allows (gateway/engine/cpu_threads.py): the cores this
process may use at start, one while other processes hold them, and the count never changes a
number the engine computes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gateway.engine import cpu_threads
from gateway.engine.cpu_threads import ThreadGovernor, cgroup_cpu_quota, usable_cpus
from gateway.engine.model_loader import load_model
from gateway.settings import load_settings


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_loaded_model_runs_on_the_cores_this_process_may_use(tiny_model_dir, restore_threads):
    torch.set_num_threads(64)  # what torch would pick on a 64-core host whatever the container's share
    load_model(load_settings(overrides={"model": str(tiny_model_dir("llama")), "device": "cpu"}, environ={}))
    assert torch.get_num_threads() == usable_cpus() <= len(os.sched_getaffinity(0))


def test_a_cgroup_cpu_quota_caps_the_threads(monkeypatch, tmp_path):
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(cpu_threads, "_CGROUP_V2", cpu_max)
    cpu_max.write_text("max 100000\n")
    assert cgroup_cpu_quota() is None
    assert usable_cpus() == len(os.sched_getaffinity(0))
    cpu_max.write_text("50000 100000\n")  # half a CPU: one thread, never none
    assert cgroup_cpu_quota() == 0.5
    assert usable_cpus() == 1


def test_the_threads_are_the_cores_other_processes_leave():
    governor = ThreadGovernor(4)
    assert [governor.threads_for(others) for others in (0.0, 0.2, 1.0, 2.6, 3.9, 12.0)] == [4, 4, 3, 1, 1, 1]


@pytest.fixture
def busy_cores() -> Iterator[int]:
    """Every usable core held by another process, as a busy machine's are."""
    count = usable_cpus()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    yield count
    for hog in hogs:
        hog.kill()
        hog.wait()


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat")
def test_on_cores_other_processes_hold_the_engine_runs_one_thread(busy_cores, restore_threads):
    governor = ThreadGovernor(max(2, busy_cores), every_s=0.5)
    deadline = time.monotonic() + 30
    while governor.adjust() != 1 and time.monotonic() < deadline:
        time.sleep(0.1)  # a measurement window, not a synchronisation
    assert governor.threads == 1 == torch.get_num_threads()


@pytest.mark.parametrize("rows", [1, 2, 16, 37, 128])
def test_one_and_two_threads_give_the_same_numbers(rows, restore_threads):
    """SmolLM2's products (576 wide; 192 to 49,152 out), its norm, and attention over 2,000 keys as
    the torch backend computes it: a chunk of `rows` tokens through SDPA (grouped heads, causal
    mask), one token as matrix products. Not a 3-token chunk: SDPA's CPU kernel splits that one's
    work by the thread count (its last bits differ; see gateway/engine/cpu_threads.py)."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen)
    weights = [torch.randn(n, 576, generator=gen) for n in (192, 576, 1536, 49152)]
    q, k, v = torch.randn(1, 9, rows, 64, generator=gen), *(torch.randn(1, 3, 2000, 64, generator=gen) for _ in "kv")
    mask = torch.ones(rows, 2000, dtype=torch.bool).tril(2000 - rows)

    def attention() -> torch.Tensor:
        if rows > 1:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        scores = torch.matmul(q.reshape(3, 3, 64), k[0].transpose(1, 2)) * 0.125
        return torch.matmul(torch.softmax(scores, dim=-1), v[0])

    def compute(threads: int) -> list[torch.Tensor]:
        torch.set_num_threads(threads)
        return [*(F.linear(x, w) for w in weights), F.rms_norm(x, (576,)), attention()]

    assert all(torch.equal(a, b) for a, b in zip(compute(2), compute(1), strict=True))


def test_a_model_gives_the_same_logits_on_one_and_two_threads(tiny_model_dir, restore_threads):
    loaded = load_model(load_settings(overrides={"model": str(tiny_model_dir("llama")), "device": "cpu"},
                                      environ={}))
    ids = loaded.tokenizer("Which channel sold the most this month? " * 20, return_tensors="pt").input_ids

    def logits(threads: int) -> torch.Tensor:
        torch.set_num_threads(threads)
        with torch.no_grad():
            return loaded.model(ids).logits  # type: ignore[no-any-return]

    assert torch.equal(logits(2), logits(1))


def test_threads_follow_other_processes_only_when_asked():
    """A thread count that changes between a hit and its bypass can change a product's last bits
    (torch 2.13 on this CPU: 5- and 7-row products, a 1- or 3-token chunk's SDPA), so the engine
    adapts its threads only with `adaptive_threads`; by default cached output stays bitwise equal
    to uncached output whatever else the machine runs."""
    from types import SimpleNamespace

    from gateway.serving.runtime import _thread_governor

    cpu = SimpleNamespace(device=torch.device("cpu"))
    assert _thread_governor(load_settings(environ={}), cpu) is None  # type: ignore[arg-type]
    adaptive = load_settings(overrides={"adaptive_threads": True}, environ={})
    assert isinstance(_thread_governor(adaptive, cpu), ThreadGovernor)  # type: ignore[arg-type]
    fixed = load_settings(overrides={"adaptive_threads": True, "num_threads": 2}, environ={})
    assert _thread_governor(fixed, cpu) is None  # type: ignore[arg-type]
