"""`toolkv cache` and pins, without a server: `warm --pin` (or a file's `"pin": true`) pins the
group it compiles, `ls` marks pinned entries and sums their bytes against pinned_budget_bytes,
and a server on the same cache dir finds the group pinned."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from gateway.settings import format_size, load_settings
from tests.kvcache.test_pinning import GROUPS, _tools
from tests.support.cache_cli import cache_cli
from tests.support.server import serve

Cli = Callable[..., tuple[int, str, str]]


@pytest.fixture
def cli(tiny_model_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> Iterator[Cli]:
    """`toolkv cache ...` through the real CLI entry point, in this process."""
    yield from cache_cli(tiny_model_dir("llama"), monkeypatch, capsys, TOOLKV_PINNED_BUDGET_BYTES="512MiB")


def write_group(tmp_path: Path, group: int, **extra: object) -> str:
    path = tmp_path / f"group-{group}.json"
    path.write_text(json.dumps({"system": GROUPS[group], "tools": _tools(group), **extra}))
    return str(path)


def test_warm_pin_pins_the_group_and_ls_shows_it_with_the_budget(cli: Cli, tiny_model_dir: Callable[..., Path],
                                                                  tmp_path: Path) -> None:
    at = ("--cache-dir", str(tmp_path / "cache"))
    code, out, err = cli("warm", write_group(tmp_path, 0), "--pin", *at)
    assert code == 0, err
    pinned = json.loads(out)
    code, out, err = cli("warm", write_group(tmp_path, 1, pin=True), *at)  # the file asks for it
    assert code == 0, err
    also = json.loads(out)
    code, out, err = cli("warm", write_group(tmp_path, 2), *at)
    assert code == 0, err
    plain = json.loads(out)
    assert (pinned["pinned"], also["pinned"], plain["pinned"]) == (True, True, False)

    code, out, _ = cli("ls", "--json", *at)
    assert {e["id"]: e["pinned"] for e in json.loads(out)} == {pinned["id"]: True, also["id"]: True,
                                                               plain["id"]: False}
    code, out, err = cli("ls", *at)
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert out.splitlines()[0].split()[6] == "PINNED"  # after LAST USED, a date and a time
    assert [rows[e["id"]][6] for e in (pinned, also, plain)] == ["yes", "yes", "-"]
    pinned_bytes = pinned["bytes"] + also["bytes"]
    assert f"2 pinned, {format_size(pinned_bytes)} of pinned_budget_bytes 512 MiB" in err

    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "min_prefix_tokens": 8,
                                        "cache_dir": str(tmp_path / "cache")}, environ={})
    with serve(settings) as live:
        listing = httpx.get(live.api_url + "/cache", timeout=60).json()
    assert {e["id"]: e["pinned"] for e in listing["data"]} == {pinned["id"]: True, also["id"]: True,
                                                               plain["id"]: False}
    assert listing["pinned_bytes"] == pinned_bytes


def test_warm_pin_past_the_budget_is_one_line_naming_the_setting(cli: Cli, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOOLKV_PINNED_BUDGET_BYTES", "0")
    code, _, err = cli("warm", write_group(tmp_path, 0), "--pin", "--cache-dir", str(tmp_path / "cache"))
    last = err.strip().splitlines()[-1]  # after the model's log lines
    assert code == 1 and last.startswith("toolkv: cannot pin") and "pinned_budget_bytes" in last, err
