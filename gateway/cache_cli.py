"""`toolkv cache ls | warm FILE | rm ID | clear`, working on a cache dir without a server.

`ls`, `rm` and `clear` read and change the disk tier only (a running server's RAM tier is its
own). `warm` loads the model itself, compiles the group and writes it to disk, where a server
using the same cache dir finds it on its next lookup.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gateway.errors import APIError
from gateway.kvcache.disk_tier import DiskRecord, DiskTier
from gateway.settings import Settings, SettingsError

_ENTRY_ID = re.compile(r"[0-9a-f]{64}")


def register(sub: Any) -> None:
    """Add the `cache` subcommand to the CLI's subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", help="the cache dir (default: from settings)")
    common.add_argument("--config", help="a TOML settings file (default: config/toolkv.toml if present)")
    common.set_defaults(host=None, port=None, model=None)
    cache = sub.add_parser("cache", help="list, warm and remove cached tool groups (no server needed)")
    actions = cache.add_subparsers(dest="action", required=True)
    ls = actions.add_parser("ls", parents=[common], help="list the entries on disk")
    ls.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    ls.set_defaults(func=_ls)
    warm = actions.add_parser("warm", parents=[common], help="compile a tool group and store it on disk")
    warm.add_argument("file", help='JSON: {"tools": [...], "system": "..."} or a list of tools')
    warm.add_argument("--model", help="the model to compile with (default: from settings)")
    warm.set_defaults(func=_warm)
    rm = actions.add_parser("rm", parents=[common], help="remove one entry by id")
    rm.add_argument("id", help="an entry id, as `toolkv cache ls` prints it")
    rm.set_defaults(func=_rm)
    clear = actions.add_parser("clear", parents=[common], help="remove every entry")
    clear.set_defaults(func=_clear)


# ---- commands ----------------------------------------------------------------------------------


def _ls(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if settings is None:
        return 2
    records = _disk(settings).records()
    if args.json:
        print(json.dumps([_record_dict(r) for r in records], indent=2))
        return 0
    print(f"{'ID':64}  {'GROUP':19}  {'TOKENS':>6}  {'BYTES':>11}  {'LAST USED':19}  TOOLS")
    for r in reversed(records):  # most recently used first
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.last_used_at))
        print(f"{r.digest}  {r.group_id:19}  {r.num_tokens:>6}  {r.num_bytes:>11}  {used}  "
              f"{','.join(r.tool_names)}")
    print(f"{len(records)} entries, {sum(r.num_bytes for r in records)} bytes in {settings.resolved_cache_dir}",
          file=sys.stderr)
    return 0


def _rm(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if settings is None:
        return 2
    if not _ENTRY_ID.fullmatch(args.id):
        print(f"toolkv: '{args.id}' is not an entry id (64 lowercase hex characters, as `toolkv cache ls` "
              "prints them)", file=sys.stderr)
        return 2
    if not _disk(settings).remove(args.id):
        print(f"toolkv: no entry {args.id} in {settings.resolved_cache_dir}", file=sys.stderr)
        return 1
    print(f"removed {args.id}")
    return 0


def _clear(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if settings is None:
        return 2
    count = _disk(settings).clear()
    print(f"removed {count} entries from {settings.resolved_cache_dir}")
    return 0


def _warm(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if settings is None:
        return 2
    try:
        request = _read_warm_file(Path(args.file))
    except (OSError, ValueError) as exc:
        print(f"toolkv: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    from gateway.cli import configure_logging

    configure_logging(settings)
    try:
        warmed, on_disk = _warm_with_model(settings, request)
    except APIError as exc:
        print(f"toolkv: {exc.message}", file=sys.stderr)
        return 1
    print(json.dumps({**warmed, "on_disk": on_disk}, indent=2))
    if not on_disk:
        print("toolkv: the entry could not be written to disk (see the warning above)", file=sys.stderr)
    return 0 if on_disk else 1


# ---- helpers -----------------------------------------------------------------------------------


def _warm_with_model(settings: Settings, request: Any) -> tuple[dict[str, Any], bool]:
    from gateway.cache_admin import compile_plan, plan_warm
    from gateway.metrics import Metrics
    from gateway.runtime import build_runtime

    runtime = build_runtime(settings, Metrics())
    try:
        plan = plan_warm(runtime.service, request, settings.max_tools)
        warmed = runtime.engine.call(lambda: compile_plan(runtime.engine, plan)).result()
    finally:
        runtime.engine.stop()  # also finishes the disk write
    disk = runtime.store.disk
    on_disk = disk is not None and disk.path_for(warmed.digest).is_file()
    return warmed.to_dict(), on_disk


def _read_warm_file(path: Path) -> Any:
    from gateway.cache_admin import WarmRequest

    data = json.loads(path.read_text())
    if isinstance(data, list):
        data = {"tools": data}
    try:
        return WarmRequest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the file"
        raise ValueError(f"{where}: {first['msg']}") from None


def _settings(args: argparse.Namespace) -> Settings | None:
    from gateway.cli import settings_from_args

    try:
        return settings_from_args(args)
    except SettingsError as exc:
        print(f"toolkv: {exc}", file=sys.stderr)
        return None


def _disk(settings: Settings) -> DiskTier:
    return DiskTier(settings.resolved_cache_dir, settings.disk_budget_bytes)


def _record_dict(record: DiskRecord) -> dict[str, Any]:
    return {"id": record.digest, "group_id": record.group_id, "tool_names": list(record.tool_names),
            "prefix_tokens": record.num_tokens, "bytes": record.num_bytes,
            "created_at": round(record.created_at, 3), "last_used_at": round(record.last_used_at, 3),
            "model_fingerprint": record.identity.get("model_fingerprint")}
