"""deploy/gpu/probe.py, the GPU session's in-process stage, run on the CPU on a tiny model: the
script is only run where a GPU is lent (rarely), so this keeps it working against the engine as
it is. Eagerly here, every part must still give its numbers (none may fail)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_probe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_probe", ROOT / "deploy" / "gpu" / "probe.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_probe_runs_every_part_on_the_cpu(tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    results = load_probe().main([str(tiny_model_dir("qwen3")), "--context", "16", "--batches", "1,2",
                                 "--long-chunk", "32", "--repeats", "2", "--tools", "2", "--max-tokens", "6",
                                 "--out", str(out)])
    assert [k for k in results if k.endswith("_error")] == [], {k: v for k, v in results.items() if "error" in k}
    assert json.loads(out.read_text()) == json.loads(json.dumps(results, default=str))  # what comes back

    assert results["engine"]["model_impl"] == "owned" and results["engine"]["device"] == "cpu"
    for batch in (1, 2):
        times = results["device_times"][f"decode x{batch}"]
        assert all(times[k] > 0 for k in ("step_read_back_ms_greedy", "ahead_ms_per_step_greedy",
                                          "step_read_back_ms_bitmask", "ahead_ms_per_step_bitmask"))
        step = results["breakdown"][f"decode x{batch} eager"]
        assert step["kernels_per_step"]["gemm"] > 0 and step["kernels_per_layer"] > 0
    assert results["breakdown"]["chunk 32 eager (a cold group's)"]["total_us_per_step"] > 0

    stream = results["stream"]
    assert stream["first (the group's miss)"]["cache"] == "miss"
    auto = stream["tool_choice auto, launched ahead"]
    assert auto["cache"] == "hit" and auto["tokens"] and auto["constrained_tokens"] > 0
    assert stream["tool_choice none, launched ahead"]["constrained_tokens"] == 0
    chunked = stream["tool_choice required, forced tokens as one chunk"]
    stepped = stream["tool_choice required, forced tokens one step each"]
    assert chunked["forced_tokens"] > 0 and chunked["tokens"] == stepped["tokens"]


def test_the_one_device_command_parses() -> None:
    """`measure.sh` runs only on a lent GPU: a syntax error there would cost the whole session."""
    script = ROOT / "deploy" / "gpu" / "measure.sh"
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
