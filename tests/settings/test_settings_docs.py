"""docs/configuration.md's settings reference is generated from `gateway.settings.Settings` and
the CLI's flags (docs/gen_settings_table.py): a setting added, or a default, description or flag
changed, without `python docs/gen_settings_table.py --write` fails here. No model is loaded."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import Field
from pydantic.fields import FieldInfo

from gateway.settings import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "gen_settings_table.py"


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_settings_table", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_table_is_up_to_date(gen: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    code = gen.main(["--check"])
    assert code == 0, capsys.readouterr().err  # the diff, and the command that regenerates the table


def test_every_setting_has_a_row_with_its_flag_env_var_and_default(gen: ModuleType) -> None:
    table = gen.render()
    rows = {line.split(" | ")[0].strip("| `"): line for line in table.splitlines() if line.startswith("| `")}
    assert list(rows) == list(Settings.model_fields)
    flags = gen.cli_flags()
    for name, row in rows.items():
        assert f"`{ENV_PREFIX}{name.upper()}`" in row
        assert all(f"`{flag}`" in row for flag in flags[name]), name
    assert "`--api-key`" in rows["api_keys"] and "`--max-num-seqs`" in rows["max_batch"]
    assert "`--gpu-memory-utilization`" in rows["gpu_memory_utilization"]
    assert "`1 GiB`" in rows["pinned_budget_bytes"]


def test_check_fails_when_a_default_or_description_changes(gen: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    field = Settings.model_fields["port"]
    monkeypatch.setattr(field, "default", 8001)
    assert gen.main(["--check"]) == 1
    assert "gen_settings_table.py --write" in capsys.readouterr().err
    monkeypatch.setattr(field, "default", 8000)
    monkeypatch.setattr(field, "description", "another description")
    assert gen.main(["--check"]) == 1


def test_check_fails_when_a_setting_is_added(gen: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(Settings.model_fields, "new_setting", FieldInfo.from_annotated_attribute(
        int, Field(1, description="a setting the docs do not know yet")))
    assert "`TOOLKV_NEW_SETTING`" in gen.render()
    assert gen.main(["--check"]) == 1


def test_check_fails_when_the_markers_are_missing(gen: ModuleType) -> None:
    with pytest.raises(SystemExit):
        gen.splice("# Configuration\n", "| table |\n")


def test_the_script_runs_on_its_own() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=ROOT / "docs", capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
