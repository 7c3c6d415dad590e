"""A disk hit is as good as a RAM hit: for each model family, the KV restored from disk after a
restart is bitwise the KV that was computed, and the greedy tokens are the same."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.serving.runtime import Runtime
from tests.engine.conftest import generate, make_runtime
from tests.kvcache.entries import bitwise_equal

ARCHS = ["llama", "qwen2", "mistral"]


def _body(tools: list[dict[str, Any]]) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "You are a merchant assistant."},
                         {"role": "user", "content": "What was GMV last week?"}],
            "tools": tools, "temperature": 0, "max_tokens": 16}


@pytest.mark.parametrize("arch", ARCHS)
def test_a_disk_hit_after_a_restart_gives_the_same_tokens_as_the_first_run(
        tiny_model_dir: Callable[..., Path], merchant_tools: list[dict[str, Any]], tmp_path: Path, arch: str) -> None:
    request = _body(merchant_tools[:4])
    first: Runtime = make_runtime(tiny_model_dir(arch), cache_dir=str(tmp_path))
    try:
        miss = generate(first, request)
        [computed] = first.store.ram.entries()
    finally:
        first.engine.stop()  # a restart: RAM is gone, the disk write is finished
    restarted = make_runtime(tiny_model_dir(arch), cache_dir=str(tmp_path))
    try:
        from_disk = generate(restarted, request)
        [restored] = restarted.store.ram.entries()
        from_ram = generate(restarted, request)
    finally:
        restarted.engine.stop()
    assert (miss.prefilled.result, from_disk.prefilled.tier, from_ram.prefilled.tier) == ("miss", "disk", "ram")
    assert bitwise_equal(restored, computed)
    assert miss.finished.token_ids == from_disk.finished.token_ids == from_ram.finished.token_ids
