"""The `toolkv` command: every failure is one line on stderr naming the problem and a non-zero
exit status, never a Python traceback. Each kind of failure runs as a user runs it (its own
process, ~4 s of imports each); the other bad tools files, which take the same way out of the
same entry point, run through `main` in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.cache_cli import cache_cli

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def toolkv(*args: str, cwd: Path, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLKV_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout_s)


def assert_one_line_error(result: subprocess.CompletedProcess[str] | tuple[int, str, str], *expected: str) -> str:
    """`result`: a process's, or (exit code, stdout, stderr) of `main` run in this process."""
    code, stdout, stderr = (result.returncode, result.stdout, result.stderr) if isinstance(
        result, subprocess.CompletedProcess) else result
    assert code != 0, stdout
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("toolkv: ")]
    assert len(lines) == 1, stderr
    assert all(part in lines[0] for part in expected), lines[0]
    return lines[0]


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def tools_file(tmp_path: Path, tools: Any, name: str = "tools.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(tools) if not isinstance(tools, str) else tools)
    return path


def tool(name: str = "get_weather", parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": "Weather for a city.",
                                             "parameters": parameters or {"type": "object"}}}


@pytest.fixture
def warm(tmp_path: Path, tiny_model_dir: Callable[..., Path]) -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(path: Path | str, *extra: str) -> subprocess.CompletedProcess[str]:
        return toolkv("cache", "warm", str(path), "--model", str(tiny_model_dir()),
                      "--cache-dir", str(tmp_path / "cache"), *extra, cwd=tmp_path)

    return run


@pytest.fixture
def warm_here(tmp_path: Path, tiny_model_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch,
              capsys: pytest.CaptureFixture[str]) -> Iterator[Callable[..., tuple[int, str, str]]]:
    """`toolkv cache warm FILE` through `main` in this process: (exit code, stdout, stderr)."""
    with contextmanager(cache_cli)(tiny_model_dir(), monkeypatch, capsys) as run:
        yield lambda path: run("warm", str(path), "--cache-dir", str(tmp_path / "cache"))


def test_cache_warm_with_a_deeply_nested_schema_is_one_line_not_a_traceback(tmp_path: Path, warm: Any,
                                                                           warm_here: Any) -> None:
    # Python's json gives up (RecursionError) near 1,000 levels; pydantic, orjson and the chat
    # template at other depths: the depth is measured before any of them sees the document.
    very_deep = json.dumps([tool(parameters={"default": "DEEP"})]).replace('"DEEP"', "[" * 5000 + "]" * 5000)
    assert_one_line_error(warm(tools_file(tmp_path, very_deep)), "nests deeper")
    line = assert_one_line_error(warm_here(tools_file(tmp_path, [tool(parameters=nested(300))])), "nests deeper")
    assert "tools[0].function.parameters" in line


@pytest.mark.parametrize(("content", "expected"), [
    (None, "No such file"),
    ("{not json", "not valid JSON"),
    ('"a string"', "expected"),
    (json.dumps([{"type": "function", "function": {"description": "no name"}}]), "tools.0.function.name"),
    (json.dumps({"tools": "not a list"}), "tools"),
])
def test_cache_warm_with_a_bad_file_is_one_line_not_a_traceback(
        tmp_path: Path, warm_here: Any, content: str | None, expected: str) -> None:
    path = tools_file(tmp_path, content) if content is not None else tmp_path / "missing.json"
    assert_one_line_error(warm_here(path), expected)


def test_cache_warm_with_a_model_that_cannot_load_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    path = tools_file(tmp_path, [tool()])
    result = toolkv("cache", "warm", str(path), "--model", str(tmp_path / "no-such-model"),
                    "--cache-dir", str(tmp_path / "cache"), cwd=tmp_path)
    assert_one_line_error(result, "cannot load the model")


@pytest.mark.parametrize("command", ["ls", "clear"])
def test_cache_commands_on_an_unreadable_cache_dir_are_one_line_not_a_traceback(
        tmp_path: Path, command: str) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)  # unreadable even for root, who reads a mode-000 dir
    result = toolkv("cache", command, "--cache-dir", str(loop), cwd=tmp_path)
    assert_one_line_error(result, "cannot use the cache dir", "symbolic links")


def test_serve_with_a_bad_setting_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    config = tmp_path / "toolkv.toml"
    config.write_text('allowed_hosts = "not a list"\n')
    assert_one_line_error(toolkv("serve", "--config", str(config), cwd=tmp_path), "allowed_hosts")


def test_serve_with_a_model_that_does_not_exist_stops_with_one_line(tmp_path: Path) -> None:
    result = toolkv("serve", "--model", str(tmp_path / "no-such-model"), "--port", "1", cwd=tmp_path, timeout_s=60)
    assert_one_line_error(result, "no-such-model")  # before: the server started and logged a traceback
