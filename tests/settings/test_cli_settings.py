"""The command line built from the settings declaration: a flag with help for every setting, vLLM's
names, `toolkv serve [MODEL]`, precedence cli > env > file > default, sizes, an unknown TOOLKV_*
variable as a warning, `toolkv config` naming where each value came from, and `--version`."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway import __version__
from gateway.cli.main import main
from gateway.settings import Settings, SettingsError, load_settings, parse_size

cli_main = importlib.import_module("gateway.cli.main")  # the module (the package's `main` is the function)
ROOT = Path(__file__).resolve().parents[2]
GiB = 1024**3


@pytest.fixture(autouse=True)
def _no_toolkv_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.upper().startswith("TOOLKV_")]:
        monkeypatch.delenv(name)


def _subcommand(name: str) -> argparse.ArgumentParser:
    parser = cli_main._parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = sub.choices[name]
    return found


def _config_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["config", "--json", *args]) == 0
    document: dict[str, Any] = json.loads(capsys.readouterr().out)
    return document


@pytest.mark.parametrize("command", ["serve", "config"])
def test_every_setting_is_a_flag_with_help(command: str) -> None:
    by_dest = {a.dest: a for a in _subcommand(command)._actions}
    for name, field in Settings.model_fields.items():
        assert field.description, f"{name} has no description"
        action = by_dest.get(name)
        assert action is not None, f"no flag for {name}"
        assert action.help and field.description.replace("%", "%%") in action.help
        assert action.option_strings, name


def test_serve_help_lists_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--api-key", "--served-model-name", "--max-model-len", "--port", "--host", "--dtype", "--device",
                 "--log-level", "--max-num-seqs", "--block-size", "--upstream", "--ram-budget-bytes", "MODEL"):
        assert flag in text, flag
    for name in Settings.model_fields:
        assert f"--{name.replace('_', '-')}" in text or name in ("api_keys", "upstreams"), name


def test_vllm_names_and_the_positional_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    doc = _config_json(capsys, "--config", str(empty), "my-model", "--api-key", "k1", "--api-key", "k2,k3",
                       "--served-model-name", "served", "--max-model-len", "4096", "--port", "9123",
                       "--host", "0.0.0.0", "--dtype", "float16", "--device", "cpu", "--log-level", "debug",
                       "--max-num-seqs", "5", "--block-size", "32", "--no-cuda-graphs", "--upstream-routing",
                       "round_robin")
    values = {name: entry["value"] for name, entry in doc["settings"].items()}
    assert values["model"] == "my-model" and doc["settings"]["model"]["source"] == "cli"
    assert values["api_keys"] == "<hidden>"  # never printed
    assert (values["served_model_name"], values["max_model_len"], values["port"], values["host"]) == \
        ("served", 4096, 9123, "0.0.0.0")
    assert (values["dtype"], values["device"], values["log_level"]) == ("float16", "cpu", "debug")
    assert (values["max_batch"], values["kv_block_tokens"], values["cuda_graphs"]) == (5, 32, False)
    assert values["upstream_routing"] == "round_robin"
    args = _subcommand("serve").parse_args(["--api-key", "k1", "--api-keys", "k2, k3"])
    assert cli_main.cli_overrides(args) == {"api_keys": ("k1", "k2", "k3")}


def test_the_model_given_twice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "a-model", "--model", "another"]) == 2
    assert "given twice" in capsys.readouterr().err
    args = _subcommand("serve").parse_args(["same", "--model", "same"])
    assert cli_main.cli_overrides(args) == {"model": "same"}


def test_precedence_cli_over_env_over_file_over_default(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "t.toml"
    config.write_text('port = 9001\nmax_queue = 11\ndtype = "float16"\nmin_prefix_tokens = 32\n')
    monkeypatch.setenv("TOOLKV_PORT", "9002")
    monkeypatch.setenv("TOOLKV_MAX_QUEUE", "12")
    doc = _config_json(capsys, "--config", str(config), "--port", "9003")
    got = {name: (entry["value"], entry["source"]) for name, entry in doc["settings"].items()}
    assert got["port"] == (9003, "cli")
    assert got["max_queue"] == (12, "env")
    assert got["dtype"] == ("float16", "file") and got["min_prefix_tokens"] == (32, "file")
    assert got["max_tools"] == (256, "default")
    assert doc["config_file"] == str(config) and doc["version"] == __version__


def test_config_prints_each_setting_and_its_source(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "t.toml"
    config.write_text('ram_budget_bytes = "8GiB"\nadmin_key = "s3cret"\n')
    monkeypatch.setenv("TOOLKV_MAX_QUEUE", "12")
    assert main(["config", "--config", str(config), "--port", "9003"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:]}
    assert set(rows) == set(Settings.model_fields)
    assert rows["port"] == ["9003", "cli"]
    assert rows["max_queue"] == ["12", "env", "(TOOLKV_MAX_QUEUE)"]
    assert rows["ram_budget_bytes"] == [str(8 * GiB), "(8", "GiB)", "file"]
    assert rows["max_tools"] == ["256", "default"]
    assert rows["admin_key"] == ["<hidden>", "file"] and "s3cret" not in out
    assert str(config) in out.splitlines()[0]


@pytest.mark.parametrize(("text", "expected"), [
    ("8GiB", 8 * GiB), ("8 GiB", 8 * GiB), ("1.5 GiB", 3 * GiB // 2), ("512MB", 512 * 1000**2),
    ("64kib", 64 * 1024), ("4096", 4096), (" 10 B ", 10), ("2TB", 2 * 1000**4), (4096, 4096),
])
def test_sizes(text: Any, expected: int) -> None:
    assert parse_size(text) == expected


def test_every_byte_budget_takes_sizes_from_file_env_and_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "t.toml"
    config.write_text('ram_budget_bytes = "8GiB"\nmax_tool_schema_bytes = 65536\n')
    monkeypatch.setenv("TOOLKV_DISK_BUDGET_BYTES", "512MB")
    doc = _config_json(capsys, "--config", str(config), "--max-request-bytes", "1.5 MiB",
                       "--max-stored-response-bytes", "1GiB", "--upstream-max-body-bytes", "2 MiB")
    values = {name: entry["value"] for name, entry in doc["settings"].items()}
    assert values["ram_budget_bytes"] == 8 * GiB
    assert values["disk_budget_bytes"] == 512 * 1000**2
    assert values["max_tool_schema_bytes"] == 65536
    assert values["max_request_bytes"] == 3 * 1024**2 // 2
    assert (values["max_stored_response_bytes"], values["upstream_max_body_bytes"]) == (GiB, 2 * 1024**2)
    byte_settings = {name for name in Settings.model_fields if name.endswith("_bytes")}
    for name in byte_settings:
        assert load_settings(overrides={name: "64KiB"}, environ={}).model_dump()[name] == 64 * 1024, name


@pytest.mark.parametrize("bad", ["8 GB/s", "eight", "8XB", "-1GiB"])
def test_a_bad_size_names_the_setting(bad: str) -> None:
    with pytest.raises(SettingsError, match=r"'ram_budget_bytes'.*TOOLKV_RAM_BUDGET_BYTES"):
        load_settings(environ={"TOOLKV_RAM_BUDGET_BYTES": bad})


def test_an_unknown_toolkv_variable_is_a_warning_and_serve_starts(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    started: list[Settings] = []
    monkeypatch.setattr(cli_main, "configure_logging", lambda settings: None)  # keep caplog's handler
    monkeypatch.setattr(cli_main, "_run_server", started.append)
    monkeypatch.setenv("TOOLKV_MAX_QEUE", "3")
    monkeypatch.setenv("TOOLKV_PORT", "9004")
    with caplog.at_level(logging.WARNING):
        assert main(["serve", "--upstream", "http://127.0.0.1:9"]) == 0
    assert [s.port for s in started] == [9004]
    [record] = [r for r in caplog.records if "TOOLKV_MAX_QEUE" in r.getMessage()]
    assert record.levelno == logging.WARNING and "TOOLKV_MAX_QUEUE" in record.getMessage()  # the closest name


def test_an_unknown_key_in_the_file_stops_config_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "t.toml"
    config.write_text("max_qeue = 3\n")
    assert main(["config", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "max_qeue" in err and "max_queue" in err and str(config) in err


@pytest.mark.parametrize("argv", [["--version"], ["serve", "--version"]])
def test_version(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"toolkv {__version__}"


def test_version_from_the_command() -> None:
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "--version"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == f"toolkv {__version__}", done.stderr


# ---- vLLM's serve flags ----------------------------------------------------------------------


def test_vllm_tool_flags_are_accepted_and_config_shows_what_they_resolve_to(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    template = tmp_path / "tool_chat_template.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    doc = _config_json(capsys, "Qwen/Qwen2.5-7B-Instruct", "--enable-auto-tool-choice", "--tool-call-parser",
                       "hermes", "--chat-template", str(template), "--trust-remote-code")
    got = {name: (entry["value"], entry.get("resolved")) for name, entry in doc["settings"].items()}
    assert got["model"][0] == "Qwen/Qwen2.5-7B-Instruct"
    assert got["tool_call_parser"] == ("hermes", "hermes (toolkv's hermes parser)")
    assert got["adapter"] == ("auto", "chatml (from tool_call_parser)")
    assert got["chat_template"] == (str(template), str(template))
    assert got["trust_remote_code"] == (True, None)
    assert main(["config", "--tool-call-parser", "llama3_json", "--chat-template", "{{ messages[0].content }}"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:]}
    assert "llama3 (from tool_call_parser)" in rows["adapter"]
    assert "<inline template, 25 chars>" in rows["chat_template"]


@pytest.mark.parametrize("name", ["pythonic", "qwen3_coder", "granite", "internlm", "jamba"])
def test_a_tool_call_parser_toolkv_does_not_read_stops_start_up_naming_those_it_does(
        name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[Settings] = []
    monkeypatch.setattr(cli_main, "_run_server", started.append)
    assert main(["serve", "--tool-call-parser", name, "--upstream", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert f"'{name}'" in err and all(known in err for known in ("hermes", "llama3_json", "mistral")), err
    assert started == []  # nothing started


def test_a_tool_call_parser_that_contradicts_the_adapter_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--tool-call-parser", "mistral", "--adapter", "llama3"]) == 2
    assert "give one of the two" in capsys.readouterr().err
    assert main(["config", "--json", "--tool-call-parser", "mistral", "--adapter", "mistral"]) == 0


def test_the_tool_call_parser_table_names_toolkvs_parsers_and_families() -> None:
    from adapters.families import get_family
    from adapters.toolcalls.vllm_names import VLLM_TOOL_PARSERS
    from tests.support.toolcalls import get_parser

    for vllm_name, mapped in VLLM_TOOL_PARSERS.items():
        assert get_family(mapped.adapter).tool_parser == mapped.parser, vllm_name
        assert get_parser(mapped.parser).name == mapped.parser


def test_a_chat_template_that_cannot_be_read_or_parsed_stops_start_up(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["config", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "cannot read the template file" in capsys.readouterr().err
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }}\n")  # no endfor
    assert main(["config", "--chat-template", str(broken)]) == 2
    err = capsys.readouterr().err
    assert "is not a Jinja template" in err and str(broken) in err


def test_an_inline_chat_template_has_its_escapes_decoded_as_vllm_does() -> None:
    from gateway.settings import read_chat_template

    assert read_chat_template(r"{{ 'é' }}\n{{ '中' }}") == "{{ 'é' }}\n{{ '中' }}"


def test_config_shows_the_values_auto_and_the_machine_defaults_come_to(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from gateway.serving.runtime import engine_plan

    settings = load_settings(environ={})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plan = engine_plan(settings, torch.device(device))
    doc = _config_json(capsys)
    resolved = {name: entry.get("resolved") for name, entry in doc["settings"].items()}
    assert resolved["device"] == f"{device} (auto)"
    assert resolved["max_batch"] == f"{plan.max_batch} (default on {device})"
    assert resolved["prefill_chunk_tokens"] == f"{plan.chunk_tokens} (default on {device})"
    assert resolved["batch_invariant"] == f"{str(plan.batch_invariant).lower()} (default on {device})"
    assert resolved["served_model_name"] == "SmolLM2-135M-Instruct (from the model)"
    assert resolved["num_threads"].split()[0].isdigit()  # the threads the engine will run, and why
    assert main(["config", "--max-num-seqs", "3"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["max_batch"] == ["3", "cli"]  # a value given is shown as given
    assert rows["prefill_chunk_tokens"][:1] == [str(plan.chunk_tokens)] and "-" not in rows["decode_overlap"]
