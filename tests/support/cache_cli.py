"""`toolkv cache ...` through the real CLI entry point, in this process (no server)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

CacheCli = Callable[..., tuple[int, str, str]]


def cache_cli(model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
              **settings: str) -> Iterator[CacheCli]:
    """For a fixture to yield from: a runner of `toolkv cache ARGS` giving (exit code, stdout,
    stderr), with no TOOLKV_* setting but the model, a small min_prefix_tokens and `settings`
    (TOOLKV_ names); the process's logging is put back afterwards."""
    from gateway.cli.main import main

    for name in [n for n in os.environ if n.startswith("TOOLKV_")]:
        monkeypatch.delenv(name)
    for name, value in {"TOOLKV_MODEL": str(model_dir), "TOOLKV_MIN_PREFIX_TOKENS": "8", **settings}.items():
        monkeypatch.setenv(name, value)
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["cache", *args])
        out, err = capsys.readouterr()
        return code, out, err

    yield run
    root.handlers[:] = saved_handlers  # `warm` configures logging for the whole process
    root.setLevel(saved_level)
