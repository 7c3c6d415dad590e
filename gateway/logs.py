"""The gateway's log lines: text (`time LEVEL logger: message k=v ...`) or one JSON object per line
(`log_json`), at `log_level`. A request's fields ride on a record as `extra={"toolkv": {...}}`.

A leaf module (it imports only `gateway.settings`), so the CLI, `toolkv cache warm` and a Ray
worker configure logging the same way without importing the command line.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from gateway.settings import Settings

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, then the record's `toolkv` fields."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                                "logger": record.name, "msg": record.getMessage()}
        body.update(getattr(record, "toolkv", {}))
        return json.dumps(body)


class TextFormatter(logging.Formatter):
    """`TEXT_FORMAT`, then the record's `toolkv` fields as `key=value`."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = getattr(record, "toolkv", None)
        return line + (" " + " ".join(f"{k}={v}" for k, v in extra.items()) if extra else "")


_JsonFormatter = JsonFormatter  # the names the CLI module used
_TextFormatter = TextFormatter


def configure_logging(settings: Settings) -> None:
    """One stderr handler on the root logger, in the format and at the level `settings` name."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if settings.log_json else TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())
