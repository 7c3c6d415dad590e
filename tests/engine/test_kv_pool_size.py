"""The KV pool is sized to the model and the machine unless `ram_budget_bytes` says
(gateway/serving/kv_pool_size.py): on the CPU four sequences of the model's full context, within
`gpu_memory_utilization` of the RAM available; `toolkv config` says what that comes to here."""

from __future__ import annotations

import pytest

from gateway.cli.main import main as toolkv
from gateway.serving.kv_pool_size import CPU_FULL_SEQUENCES, available_ram_bytes

MiB = 1024**2
# the tiny llama of tests/support/models.py: 2 layers x (keys, values) x 2 KV heads x 16 dims x 4 bytes
TINY_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def test_the_default_pool_holds_four_full_context_sequences(runtime_for):
    runtime = runtime_for(context=4096)
    pool = runtime.engine.pool
    assert pool.shape.bytes_per_token == TINY_BYTES_PER_TOKEN
    assert pool.num_bytes == CPU_FULL_SEQUENCES * 4096 * TINY_BYTES_PER_TOKEN  # 8 MiB, not 2 GiB


def test_max_model_len_shrinks_the_default_pool(runtime_for):
    runtime = runtime_for(context=4096, max_model_len=1024)
    assert runtime.engine.pool.num_bytes == CPU_FULL_SEQUENCES * 1024 * TINY_BYTES_PER_TOKEN


def test_gpu_memory_utilization_bounds_the_pool_by_the_ram_available_on_the_cpu(runtime_for):
    share = 3 * MiB / available_ram_bytes()  # about 3 MiB of RAM, under the 8 MiB four sequences take
    runtime = runtime_for(context=4096, gpu_memory_utilization=share)
    assert 1 * MiB <= runtime.engine.pool.num_bytes <= 4 * MiB


def test_ram_budget_bytes_when_set_is_the_pool(runtime_for):
    runtime = runtime_for(context=4096, ram_budget_bytes="1MiB")
    assert runtime.engine.pool.num_bytes == 1 * MiB


def test_a_share_that_holds_no_block_stops_start_up_naming_how_the_pool_was_sized(runtime_for):
    with pytest.raises(ValueError, match=r"of RAM available.*holds no KV block"):
        runtime_for(gpu_memory_utilization=1e-12)


def test_config_shows_the_pool_this_machine_gets(capsys):
    assert toolkv(["config"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("ram_budget_bytes"))
    assert "auto: 4 sequences of the model's context" in row and "GiB of RAM available" in row
