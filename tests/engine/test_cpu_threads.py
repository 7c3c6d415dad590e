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

from gateway.engine import attention, cpu_threads
from gateway.engine.cpu_threads import ThreadGovernor, cgroup_cpu_quota, invariant_rows, usable_cpus
from gateway.engine.model_loader import load_model
from gateway.engine.model_runner import StepInputs
from gateway.engine.models.layers import project
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


SMOLLM2_PRODUCTS = (960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)  # qkv, o, gate_up, down, head


@pytest.fixture(scope="module")
def smollm2_weights() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=gen) / 24 for shape in SMOLLM2_PRODUCTS]


def test_every_product_the_engine_runs_rounds_alike_on_one_and_two_threads(smollm2_weights, restore_threads):
    """SmolLM2's products (engine/models/layers.py `project`) at every row count a step can have:
    on torch 2.13 here a 5- to 11-row product takes another path on two threads than on one, so
    the engine pads it to a count that does not (`invariant_rows`, probed at start)."""
    rows = invariant_rows(smollm2_weights, threads=2)
    assert 1 in rows and 16 in rows
    gen = torch.Generator().manual_seed(1)
    for count in (*range(1, 41), 64, 128):
        x = torch.randn(count, 1536, generator=gen)
        step = StepInputs([], [count], None, invariant=False, thread_rows=rows)  # type: ignore[arg-type]

        def products(threads: int, x: torch.Tensor = x, step: StepInputs = step) -> list[torch.Tensor]:
            torch.set_num_threads(threads)
            return [project(x[:, :w.shape[1]].contiguous(), w, None, step) for w in smollm2_weights]

        assert all(torch.equal(a, b) for a, b in zip(products(2), products(1), strict=True)), count


@pytest.mark.parametrize("new", [1, 2, 3, 5, 16, 17, 64])
def test_attention_of_a_chunk_rounds_alike_on_one_and_two_threads(new, restore_threads):
    """SmolLM2's attention (9 query heads on 3 KV heads of 64) of `new` tokens after 2,000 cached
    ones, a tool group and the row's own keys, as the torch backend computes it: a chunk of up to
    16 tokens as products read in place (SDPA splits a 3-token chunk's work by the thread count),
    a longer one through SDPA."""
    gen = torch.Generator().manual_seed(new)
    query = torch.randn(9, new, 64, generator=gen)
    group = tuple(torch.randn(3, 2000, 64, generator=gen) for _ in "kv")
    own = tuple(torch.randn(3, new, 64, generator=gen) for _ in "kv")
    hidden = torch.ones(new, 2000 + new, dtype=torch.bool).triu(2001) if new > 1 else None

    def attend(threads: int) -> torch.Tensor:
        torch.set_num_threads(threads)
        small = new <= attention.SMALL_CHUNK_TOKENS
        return (attention._attend_in_place if small else attention._attend_chunk)(query, [group, own], hidden, 0.125)

    assert torch.equal(attend(2), attend(1))


def test_a_short_chunk_in_place_equals_sdpa_to_rounding():
    """The in-place products (a hit's few new tokens) compute the attention SDPA does: causal
    inside the chunk, grouped heads folded."""
    gen = torch.Generator().manual_seed(7)
    query = torch.randn(9, 5, 64, generator=gen)
    segments = [tuple(torch.randn(3, n, 64, generator=gen) for _ in "kv") for n in (40, 5)]
    hidden = torch.ones(5, 45, dtype=torch.bool).triu(41)
    in_place = attention._attend_in_place(query, segments, hidden, 0.125)  # type: ignore[arg-type]
    fused = attention._attend_chunk(query, segments, hidden, 0.125)  # type: ignore[arg-type]
    assert torch.allclose(in_place, fused, atol=1e-5)


def test_a_model_gives_the_same_logits_on_one_and_two_threads(tiny_model_dir, restore_threads):
    loaded = load_model(load_settings(overrides={"model": str(tiny_model_dir("llama")), "device": "cpu"},
                                      environ={}))
    ids = loaded.tokenizer("Which channel sold the most this month? " * 20, return_tensors="pt").input_ids

    def logits(threads: int) -> torch.Tensor:
        torch.set_num_threads(threads)
        with torch.no_grad():
            return loaded.model(ids).logits  # type: ignore[no-any-return]

    assert torch.equal(logits(2), logits(1))


def test_threads_follow_other_processes_unless_fixed() -> None:
    """By default the engine adapts its threads on the CPU (its products round alike on any count);
    `num_threads` or `adaptive_threads: false` fix the count."""
    from types import SimpleNamespace

    from gateway.serving.runtime import _thread_governor

    cpu = SimpleNamespace(device=torch.device("cpu"))
    assert isinstance(_thread_governor(load_settings(environ={}), cpu), ThreadGovernor)  # type: ignore[arg-type]
    off = load_settings(overrides={"adaptive_threads": False}, environ={})
    assert _thread_governor(off, cpu) is None  # type: ignore[arg-type]
    fixed = load_settings(overrides={"num_threads": 2}, environ={})
    assert _thread_governor(fixed, cpu) is None  # type: ignore[arg-type]
