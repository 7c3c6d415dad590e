"""Without the `ray` extra, `toolkv serve --replicas 2` stops with the command that installs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HIDE_RAY = "import sys; sys.modules['ray'] = None; from gateway.cli import main; raise SystemExit(main(sys.argv[1:]))"


def test_replicas_without_ray_names_the_extra_to_install():
    done = subprocess.run([sys.executable, "-c", HIDE_RAY, "serve", "--replicas", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert done.returncode == 2
    assert 'pip install -e ".[ray]"' in done.stderr
    assert "Traceback" not in done.stderr
