"""`toolkv` command line: `toolkv serve [MODEL] [--SETTING VALUE ...]`, `toolkv config`, `toolkv cache`,
`toolkv bench`, `toolkv parity`, `toolkv --version`.

`serve` and `config` take a flag for every setting, built from `gateway.settings.Settings` (its
fields, their types and descriptions): the one declaration of what can be set. vLLM's names where
vLLM has the setting (`--api-key`, `--max-num-seqs`, `--block-size`, ...), else `--kebab-case-key`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo

from gateway import __version__, bench
from gateway.cli import cache as cache_cli
from gateway.cli import parity
from gateway.cli.resolved import check_vllm_flags, resolved_values
from gateway.cli_errors import CliError, run_reporting_errors
from gateway.logs import configure_logging
from gateway.settings import (
    ENV_PREFIX,
    ResolvedSettings,
    Settings,
    SettingsError,
    cli_of,
    config_or_default,
    format_size,
    is_size,
    resolve_settings,
    section_of,
    shown_value,
    split_list,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

VERSION = f"toolkv {__version__}"
SETTINGS_EPILOG = (f"Every setting is also an environment variable {ENV_PREFIX}<NAME> and a key of the config file; "
                   f"the command line wins over {ENV_PREFIX}*, which wins over the file, which wins over the "
                   "defaults. Sizes take units: 8GiB, 512MB, 1.5 GiB, or bytes. `toolkv config` prints the "
                   "effective settings and where each came from.")

log = logging.getLogger("gateway")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return run_reporting_errors(lambda: int(args.func(args)))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toolkv", description="OpenAI-compatible gateway with tool-prefix KV caching")
    parser.add_argument("--version", action="version", version=VERSION)
    sub = parser.add_subparsers(metavar="COMMAND")
    serve = sub.add_parser("serve", help="start the gateway", description="Start the gateway: load the model (or, "
                           "with --upstream, forward to OpenAI-compatible servers) and serve the OpenAI API.",
                           usage="%(prog)s [MODEL] [--SETTING VALUE ...]", epilog=SETTINGS_EPILOG,
                           allow_abbrev=False)
    serve.add_argument("--version", action="version", version=VERSION)
    add_settings_arguments(serve)
    serve.set_defaults(func=_serve)
    config = sub.add_parser("config", help="print the effective settings and where each came from",
                            description="Print every setting's effective value and its source: default, file "
                                        f"(the config file), env ({ENV_PREFIX}*) or cli (a flag). Takes the flags "
                                        "`toolkv serve` takes.",
                            usage="%(prog)s [--json] [MODEL] [--SETTING VALUE ...]", epilog=SETTINGS_EPILOG,
                            allow_abbrev=False)
    config.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    add_settings_arguments(config)
    config.set_defaults(func=_config)
    cache_cli.register(sub)
    bench.register(sub)
    parity.register(sub)
    return parser


# ---- settings on the command line --------------------------------------------------------------


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """`[MODEL]`, `--config FILE`, and a flag for every field of `Settings`, grouped by section."""
    parser.add_argument("model_arg", nargs="?", metavar="MODEL",
                        help="the model to serve (as --model)")
    parser.add_argument("--config", metavar="FILE", help="a TOML settings file (default: config/toolkv.toml if "
                                                         "present)")
    group: Any = parser
    for name, field in Settings.model_fields.items():
        title = section_of(field)
        if title is not None:
            group = parser.add_argument_group(f"{title} settings")
        _add_setting(group, name, field)
    parser.add_argument_group("vLLM's flags").add_argument(
        "--enable-auto-tool-choice", action="store_true", default=argparse.SUPPRESS,
        help="accepted for vLLM's command lines, and always the case: a request with tools and tool_choice auto "
             "(or none given) gets the model's calls parsed, in the family adapter picks (see --tool-call-parser)")


def _add_setting(group: Any, name: str, field: FieldInfo) -> None:
    cli = cli_of(field)
    flags = list(cli.flags) if cli is not None and cli.flags else [f"--{name.replace('_', '-')}"]
    options: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": _help(field)}
    kind = _bare(field.annotation)
    metavar = cli.metavar if cli is not None else None
    if kind is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif get_origin(kind) is Literal:
        options["choices"] = get_args(kind)
    elif get_origin(kind) is tuple:
        item = metavar or "ITEM"
        options.update(action="append", metavar=f"{item}[,{item}...]")
    elif is_size(field):
        options["metavar"] = metavar or "SIZE"
    elif name.endswith("_s"):
        options["metavar"] = metavar or "SECONDS"
    elif kind is int:
        options["metavar"] = metavar or "N"
    elif metavar:
        options["metavar"] = metavar
    group.add_argument(*flags, **options)


def _bare(annotation: Any) -> Any:
    """`X | None` -> X."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _help(field: FieldInfo) -> str:
    text = field.description or ""
    default = field.default
    if "default" not in text and default is not None and default != ():
        shown = format_size(default) if is_size(field) else ("on" if default else "off") if isinstance(default, bool) \
            else default
        text += f" (default: {shown})"
    return text.replace("%", "%%")  # argparse formats help with %


def cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags (and the positional MODEL), by setting name."""
    given = vars(args)
    values: dict[str, Any] = {}
    for name in Settings.model_fields:
        if name in given:
            value = given[name]
            values[name] = tuple(part for item in value for part in split_list(item)) if isinstance(value, list) \
                else value
    positional = given.get("model_arg")
    if positional is not None:
        if values.get("model", positional) != positional:
            raise CliError(f"the model is given twice ('{positional}' and --model '{values['model']}'): give it once")
        values["model"] = positional
    return values


def resolve_from_args(args: argparse.Namespace) -> ResolvedSettings:
    try:
        return resolve_settings(config_or_default(args.config), cli_overrides(args))
    except SettingsError as exc:
        raise CliError(str(exc)) from None


# ---- serve -------------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    resolved = resolve_from_args(args)
    settings = resolved.settings
    check_vllm_flags(settings)
    if settings.replicas > 1:
        return _serve_on_ray(resolved)
    if not settings.upstreams:
        _check_model_source(settings)
    _start_logging(resolved)
    if settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s: anyone who can reach it can use the model", settings.host)
    _run_server(settings)
    return 0


def _start_logging(resolved: ResolvedSettings) -> None:
    """The log format and level from the settings, then what loading them warned about."""
    configure_logging(resolved.settings)
    for line in resolved.warnings:
        logging.getLogger("gateway.settings").warning("%s", line)


def _run_server(settings: Settings) -> None:
    # lazy: uvicorn and the app (the model's torch, or the proxy's httpx) only when serving
    from gateway.edge.server import GraceServer, server_config

    app, end_generations = _app(settings)
    GraceServer(server_config(app, settings), settings.shutdown_grace_s, end_generations).run()


def _serve_on_ray(resolved: ResolvedSettings) -> int:
    """`--replicas N`: N engine replicas on Ray Serve behind one ingress (gateway/serve_ray)."""
    from gateway.serve_ray import require_ray  # lazy: Ray is an extra

    settings = resolved.settings
    if settings.upstreams:
        raise CliError("--replicas runs engines here; --upstream forwards to servers elsewhere: pick one")
    require_ray()
    _check_model_source(settings)
    _start_logging(resolved)
    from gateway.serve_ray.launch import serve_replicas  # lazy: imports ray

    return serve_replicas(settings)


def _app(settings: Settings) -> tuple[FastAPI, Callable[[], None]]:
    """Proxy mode when upstreams are set (no model is loaded, torch is never imported), else the model
    app; and what ends the generations still running at the end of the shutdown grace period (a
    proxy has none)."""
    if settings.upstreams:
        from gateway.api import dashboard  # lazy: the fleet view's page and numbers (no torch)
        from gateway.proxy.app import create_proxy_app  # lazy: the proxy's app and httpx
        from gateway.proxy.fleet.view import upstream_view  # lazy: as above

        logging.getLogger("gateway").info("proxy mode: forwarding to %s", ", ".join(settings.upstreams))
        if settings.log_level != "debug":  # httpx logs every upstream call; a request's line is the proxy's own
            logging.getLogger("httpx").setLevel(logging.WARNING)
        return create_proxy_app(settings, view=upstream_view(dashboard)), lambda: None
    from gateway.api.app import create_app, end_generations  # lazy: the model app imports torch

    app = create_app(settings)
    return app, lambda: end_generations(app)


def _check_model_source(settings: Settings) -> None:
    """A model that cannot be found stops start-up with one line; without this the server starts,
    its background load fails with a traceback in the log, and /health says `failed`."""
    from gateway.engine.model_loader import ModelLoadError, resolve_source  # lazy: imports torch

    try:
        resolve_source(settings)
    except ModelLoadError as exc:
        raise CliError(str(exc)) from None


# ---- config ------------------------------------------------------------------------------------


def _config(args: argparse.Namespace) -> int:
    resolved = resolve_from_args(args)
    for line in resolved.warnings:
        print(f"toolkv: warning: {line}", file=sys.stderr)
    check_vllm_flags(resolved.settings)
    values = resolved.settings.model_dump(mode="json")
    here = resolved_values(resolved.settings)  # what `auto` and the machine's defaults come to here
    if args.json:
        print(json.dumps({"version": __version__,
                          "config_file": str(resolved.config_file) if resolved.config_file else None,
                          "settings": {name: {"value": shown_value(name, value), "source": resolved.sources[name],
                                              **({"resolved": here[name]} if name in here else {})}
                                       for name, value in values.items()}}, indent=2))
        return 0
    print(f"# {VERSION}; config file: {resolved.config_file or 'none'}")
    rows = [(name, here.get(name) or _shown(name, value), _source(name, resolved)) for name, value in values.items()]
    width = max(len(name) for name, _, _ in rows)
    value_width = min(40, max(len(value) for _, value, _ in rows))
    print(f"{'SETTING':{width}}  {'VALUE':{value_width}}  SOURCE")
    for name, value, source in rows:
        print(f"{name:{width}}  {value:{value_width}}  {source}")
    return 0


def _shown(name: str, value: Any) -> str:
    value = shown_value(name, value)
    if value is None:
        return "-"
    if isinstance(value, list):
        return ",".join(value) if value else "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and is_size(Settings.model_fields[name]):
        return f"{value} ({format_size(value)})"
    return str(value)


def _source(name: str, resolved: ResolvedSettings) -> str:
    source = resolved.sources[name]
    return f"env ({ENV_PREFIX}{name.upper()})" if source == "env" else source


if __name__ == "__main__":
    raise SystemExit(main())
