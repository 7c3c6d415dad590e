"""Settings: TOML file, TOOLKV_* overrides, loud failures that name the key, and a warning for an
unknown TOOLKV_* variable."""

from __future__ import annotations

import logging

import pytest

from gateway.cli.main import main
from gateway.settings import SettingsError, load_settings


def test_file_then_env_then_overrides(tmp_path):
    config = tmp_path / "t.toml"
    config.write_text('port = 9000\nmin_prefix_tokens = 10\ncache = "off"\n')
    settings = load_settings(config, {"port": 9100}, environ={"TOOLKV_MIN_PREFIX_TOKENS": "20"})
    assert (settings.port, settings.min_prefix_tokens, settings.cache_enabled) == (9100, 20, False)


def test_unknown_key_in_file_is_named(tmp_path):
    config = tmp_path / "t.toml"
    config.write_text("prot = 9000\n")
    with pytest.raises(SettingsError, match="prot"):
        load_settings(config, environ={})


def test_bad_value_is_named():
    with pytest.raises(SettingsError, match="'dtype'"):
        load_settings(environ={"TOOLKV_DTYPE": "float7"})


@pytest.mark.parametrize(("name", "value", "says"), [
    ("shutdown_grace_s", "inf", "finite number"),  # the server crashed at start (int(inf))
    ("header_read_timeout_s", "nan", "finite number"),
    ("host", "", "at least 1 character"),  # '' bound every interface, past the loopback default
])
def test_a_value_no_server_can_run_with_is_named(name, value, says):
    with pytest.raises(SettingsError, match=f"'{name}'.*{says}"):
        load_settings(overrides={name: value}, environ={})


def test_unknown_env_var_is_a_warning_naming_it(caplog):
    with caplog.at_level(logging.WARNING, logger="gateway.settings"):
        settings = load_settings(environ={"TOOLKV_CACHE_SIZE": "1", "TOOLKV_PORT": "9001"})
    assert settings.port == 9001
    [record] = [r for r in caplog.records if "TOOLKV_CACHE_SIZE" in r.getMessage()]
    assert record.levelno == logging.WARNING and "TOOLKV_CACHE_DIR" in record.getMessage()


def test_unknown_key_in_file_names_the_file_and_the_closest_key(tmp_path):
    config = tmp_path / "t.toml"
    config.write_text("prot = 9000\n")
    expected = r"unknown setting 'prot' \(did you mean 'port'\?\) in config file .*t\.toml"
    with pytest.raises(SettingsError, match=expected):
        load_settings(config, environ={})


def test_serve_refuses_to_start_with_bad_settings(tmp_path, capsys, monkeypatch):
    config = tmp_path / "bad.toml"
    config.write_text('port = "eighty"\n')
    assert main(["serve", "--config", str(config)]) == 2
    assert "port" in capsys.readouterr().err
