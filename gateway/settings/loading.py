"""Loading: the TOML file, the `TOOLKV_*` environment and the command line's values merged over the
defaults (each through pydantic-settings' sources), with where each value came from, and the
warnings and errors a user reads when one is wrong."""

from __future__ import annotations

import difflib
import logging
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import EnvSettingsSource, TomlConfigSettingsSource
from pydantic_settings import SettingsError as SourceError
from pydantic_settings.sources.utils import parse_env_vars

from gateway.settings.declaration import DEFAULT_CONFIG, Settings
from gateway.settings.parts import ENV_PREFIX, SettingsError, Source, describe_errors, split_list

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResolvedSettings:
    """Settings and where each came from."""

    settings: Settings
    sources: dict[str, Source]  # every setting -> default | file | env | cli
    config_file: Path | None
    warnings: tuple[str, ...]  # unknown TOOLKV_* variables, one line each


def config_or_default(config_file: str | Path | None) -> Path | None:
    """The file named, else config/toolkv.toml when it exists (a source checkout), else none."""
    if config_file:
        return Path(config_file)
    return DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None


def load_settings(
    config_file: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build settings from a TOML file, then the environment, then `overrides` (the command line);
    unknown `TOOLKV_*` variables are logged as warnings."""
    resolved = resolve_settings(config_file, overrides, environ)
    for line in resolved.warnings:
        log.warning("%s", line)
    return resolved.settings


def resolve_settings(
    config_file: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ResolvedSettings:
    """`load_settings`, also saying where each value came from; warnings are returned, not logged."""
    environ = os.environ if environ is None else environ
    path = Path(config_file) if config_file is not None else None
    layers: list[tuple[Source, dict[str, Any]]] = [
        ("file", _read_toml(path) if path is not None else {}),
        ("env", _read_env(environ)),
        ("cli", {k: v for k, v in (overrides or {}).items() if v is not None}),
    ]
    values: dict[str, Any] = {}
    sources: dict[str, Source] = dict.fromkeys(Settings.model_fields, "default")
    for source, layer in layers:
        values.update(layer)
        sources.update(dict.fromkeys(layer, source))
    try:
        settings = Settings(**values)
    except ValidationError as exc:
        raise SettingsError(describe_errors(exc, sources, path)) from None
    return ResolvedSettings(settings, sources, path, _unknown_env(environ))


class _TomlSource(TomlConfigSettingsSource):
    """pydantic-settings' TOML source; keys may sit under a `[toolkv]` table."""

    def _read_file(self, file_path: Path) -> dict[str, Any]:
        data = super()._read_file(file_path)
        table = data.get("toolkv", data)
        return dict(table) if isinstance(table, dict) else data


class _EnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping; a list setting also takes a
    comma-separated value (`TOOLKV_API_KEYS=a,b`) besides JSON (`["a","b"]`)."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(Settings)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._environ, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)

    def prepare_field_value(self, field_name: str, field: FieldInfo, value: Any, value_is_complex: bool) -> Any:
        if field_name in LIST_SETTINGS and isinstance(value, str) and not value.lstrip().startswith("["):
            return split_list(value)
        return super().prepare_field_value(field_name, field, value, value_is_complex)


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.expanduser().is_file():
        raise SettingsError(f"config file not found: {path}")
    try:
        data = _TomlSource(Settings, toml_file=path)()
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = [key for key in data if key not in Settings.model_fields]
    if unknown:
        named = ", ".join(f"'{key}'" + _did_you_mean(key, quote="'") for key in unknown)
        raise SettingsError(f"unknown setting{'s' if len(unknown) > 1 else ''} {named} in config file {path}")
    return data


def _read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    try:
        return _EnvSource(environ)()
    except SourceError as exc:  # a list given as JSON that does not parse
        field = re.search(r'field "(\w+)"', str(exc))
        name = field.group(1) if field else "?"
        raise SettingsError(f"invalid settings: setting '{name}': {ENV_PREFIX}{name.upper()} is not a JSON list "
                            "(or give the items separated by commas)") from None


def _unknown_env(environ: Mapping[str, str]) -> tuple[str, ...]:
    lines = []
    for name in sorted(environ):
        key = name[len(ENV_PREFIX):].lower()
        if name.upper().startswith(ENV_PREFIX) and key not in Settings.model_fields:
            hint = _did_you_mean(key, prefix=ENV_PREFIX)
            lines.append(f"ignoring the environment variable {name}: no such setting{hint}")
    return tuple(lines)


def _did_you_mean(key: str, prefix: str = "", quote: str = "") -> str:
    close = difflib.get_close_matches(key.lower(), list(Settings.model_fields), n=1)
    if not close:
        return ""
    name = prefix + close[0].upper() if prefix else close[0]
    return f" (did you mean {quote}{name}{quote}?)"


LIST_SETTINGS = frozenset(name for name, field in Settings.model_fields.items()
                          if get_origin(field.annotation) is tuple)
