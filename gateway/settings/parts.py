"""The pieces the settings declaration is made of: sizes (`8GiB`), the markers a field carries (a
byte budget, its command-line names, the `--help` section it opens), the checks and readers
that several settings share, and how a bad value is worded (naming the key and where it came
from, secrets hidden). No setting is declared here (see declaration.py)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BeforeValidator, ValidationError
from pydantic.fields import FieldInfo

ENV_PREFIX = "TOOLKV_"
SECRET_SETTINGS = frozenset({"api_keys", "admin_key", "upstream_api_key", "trusted_proxy_keys"})  # never shown

Source = Literal["default", "file", "env", "cli"]


class SettingsError(ValueError):
    """A settings file or environment variable is invalid; the message names the key."""


# ---- sizes -------------------------------------------------------------------------------------

SIZE_UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
              "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(value: Any) -> Any:
    """`8GiB`, `512MB`, `1.5 GiB`, `4096` -> bytes (KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB
    of 1024, as the units say). Anything else is handed on for the int validator to refuse."""
    if not isinstance(value, str):
        return value
    match = _SIZE.fullmatch(value)
    unit = match.group(2).lower() if match else ""
    if match is None or (unit and unit not in SIZE_UNITS):
        raise ValueError(f"'{value}' is not a size: give bytes, or a number and a unit "
                         "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 8GiB or 512MB")
    try:
        return round(Decimal(match.group(1)) * SIZE_UNITS[unit or "b"])
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimal numbers
        raise ValueError(f"'{value}' is not a size") from None


def format_size(num_bytes: int) -> str:
    """Bytes as the largest binary unit that divides them (`2 GiB`), else as bytes."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        factor = SIZE_UNITS[unit.lower()]
        if num_bytes and num_bytes % factor == 0:
            return f"{num_bytes // factor} {unit}"
    return f"{num_bytes} B"


class Size:
    """Marks a byte budget: it takes `parse_size`'s forms, and is shown as a size."""


Bytes = Annotated[int, BeforeValidator(parse_size), Size()]
MaybeBytes = Annotated[int | None, BeforeValidator(parse_size), Size()]  # None: a default decided at start-up


class Cli:
    """How a setting is named on the command line when not (only) `--kebab-case-name`: vLLM's
    names first, where vLLM has the same setting."""

    def __init__(self, *flags: str, metavar: str | None = None) -> None:
        self.flags = flags
        self.metavar = metavar


def section(title: str) -> Any:
    """Opens a group of settings in `toolkv serve --help` (on the group's first field)."""
    return {"section": title}


def split_list(raw: str) -> tuple[str, ...]:
    """`a, b,c` -> ("a", "b", "c"): a list setting in the environment or on the command line."""
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def is_size(field: FieldInfo) -> bool:
    return any(isinstance(meta, Size) for meta in field.metadata)


def cli_of(field: FieldInfo) -> Cli | None:
    return next((meta for meta in field.metadata if isinstance(meta, Cli)), None)


def section_of(field: FieldInfo) -> str | None:
    extra = field.json_schema_extra
    title = extra.get("section") if isinstance(extra, dict) else None
    return title if isinstance(title, str) else None


def upstream_base_url(url: str) -> str:
    """`http(s)://host[:port][/path]` without a trailing `/` or `/v1` (the proxy appends `/v1/...`)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"'{url}' is not an http(s) URL with a host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"'{url}': give the server's base URL alone (no query, fragment or credentials)")
    try:
        parts.port  # noqa: B018  (raises on a port that is not a number)
    except ValueError:
        raise ValueError(f"'{url}' has a bad port") from None
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return f"{parts.scheme}://{parts.netloc}{path}"


# ---- wording -----------------------------------------------------------------------------------


def shown_value(name: str, value: Any) -> Any:
    """A setting's value as `toolkv config` shows it: secrets hidden."""
    if name in SECRET_SETTINGS and value:
        return "<hidden>"
    return value


_WHERE: dict[Source, str] = {"file": "from {file}", "env": "from " + ENV_PREFIX + "{key}",
                             "cli": "from the command line"}


def describe_errors(exc: ValidationError, sources: Mapping[str, Source], path: Path | None) -> str:
    """One line naming each bad setting, its value (secrets hidden) and where it came from."""
    lines = []
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"]) or "settings"
        field = str(err["loc"][0]) if err["loc"] else ""
        shown = "<hidden>" if field in SECRET_SETTINGS else repr(err.get("input"))
        source = sources.get(field, "default")
        where = f", {_WHERE[source].format(file=path, key=field.upper())}" if source != "default" else ""
        lines.append(f"setting '{key}': {err['msg']} (got {shown}{where})")
    return "invalid settings: " + "; ".join(lines)
