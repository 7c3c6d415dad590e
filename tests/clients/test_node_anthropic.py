"""@anthropic-ai/sdk, unchanged, from Node against toolkv: the SDK's default agent loop,
`client.beta.messages.toolRunner(...)`, runs over a server-side message thread (a `create`, then a
`continue` with only the tool result, `system` and `tools` left to the thread) and finishes with
the scripted model's final answer, whole and streamed. `npm ci` installs the locked package."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.clients.scenario import FINAL_ANSWER, MODEL, ORDER_ARGS, ORDER_ID, SYSTEM, hermes_calls, tool_result
from tests.support.family_models import script

NODE_DIR = Path(__file__).resolve().parent / "node"
THREADS_BETA = "message-threads-2026-08-12"


@pytest.fixture(scope="module")
def node() -> str:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("Node.js and npm are needed for the @anthropic-ai/sdk client test")
    if not (NODE_DIR / "node_modules" / "@anthropic-ai" / "sdk").is_dir():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True, timeout=600,
                       capture_output=True)
    return node


@pytest.fixture(scope="module")
def runs(node: str, scripted_server) -> dict[str, Any]:
    spec = {"model": MODEL, "system": SYSTEM,
            "messages": [{"role": "user", "content": script(hermes_calls(("get_order_details", ORDER_ARGS)))}],
            "toolResult": tool_result({"status": "delivered"}, FINAL_ANSWER)}
    done = subprocess.run([node, "anthropic_client.mjs", scripted_server.base_url, json.dumps(spec)], cwd=NODE_DIR,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout))


@pytest.mark.parametrize("mode", ["whole", "streamed"])
def test_the_default_tool_runner_finishes_over_a_thread(runs, mode):
    run = runs[mode]
    assert run["ran"] == [ORDER_ID]
    assert [(b["type"], b.get("text")) for b in run["final"]["content"]] == [("text", FINAL_ANSWER)]
    first, later = run["sent"]
    assert first["status"] == later["status"] == 200
    assert THREADS_BETA in first["beta"] and THREADS_BETA in later["beta"]
    assert first["thread"] == {"type": "create"} and later["thread"]["type"] == "continue"
    assert "system" not in later["keys"] and "tools" not in later["keys"] and later["blocks"] == ["tool_result"]
