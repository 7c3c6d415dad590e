"""`toolkv serve --replicas` errors that need no Ray: without the `ray` extra it stops with the
command that installs it; with `--upstream` it says to pick one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HIDE_RAY = ("import sys; sys.modules['ray'] = None; from gateway.cli.main import main; "
            "raise SystemExit(main(sys.argv[1:]))")


def test_replicas_without_ray_names_the_extra_to_install():
    done = subprocess.run([sys.executable, "-c", HIDE_RAY, "serve", "--replicas", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert done.returncode == 2
    assert 'pip install -e ".[ray]"' in done.stderr
    assert "Traceback" not in done.stderr


def test_replicas_and_upstreams_together_are_refused(capsys):
    from gateway.cli.main import main

    assert main(["serve", "--replicas", "2", "--upstream", "http://127.0.0.1:9"]) == 2
    assert "--replicas" in capsys.readouterr().err
