"""`toolkv cache ls | warm FILE | rm ID | clear`, working on a cache dir without a server.

`ls`, `rm` and `clear` read and change the disk tier only (a running server's RAM tier is its
own); `ls` marks pinned entries and sums them against pinned_budget_bytes. `warm` loads the model
itself, compiles the group and writes it to disk (pinned with `--pin` or `"pin": true`), where a
server using the same cache dir finds it on its next lookup.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adapters.render import RenderError
from gateway.cli_errors import EXIT_FAILURE, CliError
from gateway.errors import APIError
from gateway.logs import configure_logging
from gateway.settings import Settings, SettingsError, config_or_default, format_size, load_settings

if TYPE_CHECKING:
    from gateway.kvcache.disk_tier import DiskRecord, DiskTier
    from gateway.serving.cache_admin import Warmed, WarmRequest
    from gateway.serving.runtime import Runtime

_ENTRY_ID = re.compile(r"[0-9a-f]{64}")


def register(sub: Any) -> None:
    """Add the `cache` subcommand to the CLI's subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", help="the cache dir (default: from settings)")
    common.add_argument("--config", help="a TOML settings file (default: config/toolkv.toml if present)")
    common.set_defaults(model=None)
    cache = sub.add_parser("cache", help="list, warm and remove cached tool groups (no server needed)")
    actions = cache.add_subparsers(dest="action", required=True)
    ls = actions.add_parser("ls", parents=[common], help="list the entries on disk")
    ls.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    ls.set_defaults(func=_ls)
    warm = actions.add_parser("warm", parents=[common], help="compile a tool group and store it on disk")
    warm.add_argument("file", help='JSON: {"tools": [...], "system": "..."} or a list of tools')
    warm.add_argument("--model", help="the model to compile with (default: from settings)")
    warm.add_argument("--pin", action="store_true", help="pin the group too (never evicted, within "
                                                          "pinned_budget_bytes), as the file's \"pin\": true does")
    warm.set_defaults(func=_warm)
    rm = actions.add_parser("rm", parents=[common], help="remove one entry by id")
    rm.add_argument("id", help="an entry id, as `toolkv cache ls` prints it")
    rm.set_defaults(func=_rm)
    clear = actions.add_parser("clear", parents=[common], help="remove every entry")
    clear.set_defaults(func=_clear)


# ---- commands ----------------------------------------------------------------------------------


def _ls(args: argparse.Namespace) -> int:
    settings = _settings(args)
    with _cache_dir_errors(settings):
        disk = _disk(settings)
        records, pinned = disk.records(), disk.pins.pinned()
    if args.json:
        print(json.dumps([_record_dict(r, r.digest in pinned) for r in records], indent=2))
        return 0
    print(f"{'ID':64}  {'GROUP':19}  {'TOKENS':>6}  {'BYTES':>11}  {'LAST USED':19}  {'PINNED':6}  TOOLS")
    for r in reversed(records):  # most recently used first
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.last_used_at))
        print(f"{r.digest}  {r.group_id:19}  {r.num_tokens:>6}  {r.num_bytes:>11}  {used}  "
              f"{'yes' if r.digest in pinned else '-':6}  {','.join(r.tool_names)}")
    print(f"{len(records)} entries, {sum(r.num_bytes for r in records)} bytes in {settings.resolved_cache_dir}; "
          f"{_pinned_line(records, pinned, settings.pinned_budget_bytes)}", file=sys.stderr)
    return 0


def _pinned_line(records: list[DiskRecord], pinned: dict[str, int], budget_bytes: int) -> str:
    """How many entries are pinned and their bytes (as counted against the budget) of the budget."""
    num_pinned = sum(r.digest in pinned for r in records)
    return (f"{num_pinned} pinned, {format_size(sum(pinned.values()))} of pinned_budget_bytes "
            f"{format_size(budget_bytes)}")


def _rm(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if not _ENTRY_ID.fullmatch(args.id):
        raise CliError(f"'{args.id}' is not an entry id (64 lowercase hex characters, as `toolkv cache ls` "
                       "prints them)")
    with _cache_dir_errors(settings):
        removed = _disk(settings).remove(args.id)
    if not removed:
        raise CliError(f"no entry {args.id} in {settings.resolved_cache_dir}", EXIT_FAILURE)
    print(f"removed {args.id}")
    return 0


def _clear(args: argparse.Namespace) -> int:
    settings = _settings(args)
    with _cache_dir_errors(settings):
        count = _disk(settings).clear()
    print(f"removed {count} entries from {settings.resolved_cache_dir}")
    return 0


def _warm(args: argparse.Namespace) -> int:
    settings = _settings(args)
    request = read_warm_file(Path(args.file), settings.max_schema_depth)
    if args.pin:
        request = request.model_copy(update={"pin": True})
    configure_logging(settings)
    warmed, on_disk = _warm_with_model(settings, request)
    print(json.dumps({**warmed, "on_disk": on_disk}, indent=2))
    if not on_disk:
        print("toolkv: the entry could not be written to disk (see the warning above)", file=sys.stderr)
    return 0 if on_disk else EXIT_FAILURE


# ---- helpers -----------------------------------------------------------------------------------


def _warm_with_model(settings: Settings, request: WarmRequest) -> tuple[dict[str, Any], bool]:
    # lazy: the model runtime imports torch; `ls`, `rm` and `clear` never load a model
    from gateway.metrics import Metrics
    from gateway.serving.runtime import build_runtime  # lazy: torch, as above

    try:
        runtime = build_runtime(settings, Metrics())
    except Exception as exc:  # whatever the loader raises (missing files, a bad config, ...)
        raise CliError(f"cannot load the model '{settings.model}': {exc}", EXIT_FAILURE) from None
    try:
        warmed = _compile(runtime, request, settings)
    finally:
        runtime.engine.stop()  # also finishes the disk write
    disk = runtime.store.disk
    on_disk = disk is not None and disk.path_for(warmed.digest).is_file()
    return warmed.to_dict(), on_disk


def _compile(runtime: Runtime, request: WarmRequest, settings: Settings) -> Warmed:
    # lazy: serving imports the engine (torch)
    from gateway.serving.cache_admin import pin_entry, plan_warm, warm_plan

    try:
        plan = plan_warm(runtime.service, request, settings.max_tools, settings.max_schema_depth)
        warmed: Warmed = warm_plan(runtime.engine, plan).result()
        if request.pin:
            pinned = pin_entry(runtime.admin, warmed.digest, settings.pinned_budget_bytes, "pin") is not None
            warmed = dataclasses.replace(warmed, pinned=pinned)
        return warmed
    except APIError as exc:
        raise CliError(exc.message, EXIT_FAILURE) from None
    except RenderError as exc:
        raise CliError(str(exc), EXIT_FAILURE) from None


def read_warm_file(path: Path, max_schema_depth: int) -> WarmRequest:
    """The file's tools and system prompt; a `CliError` naming the file and the problem for
    anything else."""
    from gateway.serving.cache_admin import WarmFileError  # lazy: serving imports the engine (torch)
    from gateway.serving.cache_admin import read_warm_file as read  # lazy: as above

    try:
        return read(path, max_schema_depth)
    except WarmFileError as exc:
        raise CliError(str(exc)) from None


def _settings(args: argparse.Namespace) -> Settings:
    """The settings `toolkv serve` would use, with this command's --cache-dir and --model."""
    try:
        return load_settings(config_or_default(args.config), {"cache_dir": args.cache_dir, "model": args.model})
    except SettingsError as exc:
        raise CliError(str(exc)) from None


@contextmanager
def _cache_dir_errors(settings: Settings) -> Iterator[None]:
    """An unreadable or unwritable cache dir is one line naming it, not a traceback."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise CliError(f"cannot use the cache dir {settings.resolved_cache_dir}: {reason}", EXIT_FAILURE) from None


def _disk(settings: Settings) -> DiskTier:
    from gateway.kvcache.disk_tier import DiskTier  # lazy: imports torch, not for `toolkv serve --upstream`

    return DiskTier(settings.resolved_cache_dir, settings.disk_budget_bytes)


def _record_dict(record: DiskRecord, pinned: bool) -> dict[str, Any]:
    return {"id": record.digest, "group_id": record.group_id, "tool_names": list(record.tool_names),
            "prefix_tokens": record.num_tokens, "bytes": record.num_bytes,
            "created_at": round(record.created_at, 3), "last_used_at": round(record.last_used_at, 3),
            "pinned": pinned, "model_fingerprint": record.identity.get("model_fingerprint")}
