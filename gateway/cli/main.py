"""`toolkv` command line: `toolkv serve [--host] [--port] [--model] [--config FILE] [--cache-dir DIR]
[--upstream URL[,URL...]] [--replicas N [--ray-address ADDR]]`."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from gateway import bench
from gateway.cli import cache as cache_cli
from gateway.cli import parity
from gateway.cli_errors import CliError, run_reporting_errors
from gateway.settings import Settings, SettingsError, load_settings

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "config" / "toolkv.toml"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return run_reporting_errors(lambda: int(args.func(args)))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toolkv", description="OpenAI-compatible gateway with tool-prefix KV caching")
    sub = parser.add_subparsers()
    serve = sub.add_parser("serve", help="start the gateway")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--model", help="'smollm2' (embedded), a local HF model dir, a .gguf path or a hub id")
    serve.add_argument("--config", help="a TOML settings file (default: config/toolkv.toml if present)")
    serve.add_argument("--cache-dir")
    serve.add_argument("--upstream", metavar="URL[,URL...]",
                       help="proxy mode: no local model; forward to these OpenAI-compatible servers")
    serve.add_argument("--replicas", type=int, metavar="N",
                       help="run N engine replicas on Ray Serve behind one ingress (needs the `ray` extra)")
    serve.add_argument("--ray-address", help="an existing Ray cluster to join (default: RAY_ADDRESS, else a local one)")
    serve.add_argument("--upstream-routing", choices=("affinity", "round_robin"),
                       help="affinity (default): each tool group to its home upstream/replica; round_robin: "
                            "in turn, whatever the group (a plain load balancer, for comparison)")
    serve.add_argument("--replica-cache", choices=("shared", "separate"),
                       help="with --replicas: one cache dir for all (default) or cache-dir/engine-i each")
    serve.set_defaults(func=_serve)
    cache_cli.register(sub)
    bench.register(sub)
    parity.register(sub)
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    config = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    overrides: dict[str, Any] = {"host": args.host, "port": args.port, "model": args.model,
                                 "cache_dir": args.cache_dir, "replicas": getattr(args, "replicas", None),
                                 "ray_address": getattr(args, "ray_address", None),
                                 "upstream_routing": getattr(args, "upstream_routing", None),
                                 "replica_cache": getattr(args, "replica_cache", None)}
    if getattr(args, "upstream", None):
        overrides["upstreams"] = tuple(url.strip() for url in args.upstream.split(",") if url.strip())
    return load_settings(config, overrides)


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except SettingsError as exc:
        raise CliError(str(exc)) from None
    if settings.replicas > 1:
        return _serve_on_ray(settings)
    if not settings.upstreams:
        _check_model_source(settings)
    configure_logging(settings)
    import uvicorn

    from gateway.edge.server import server_config

    log = logging.getLogger("gateway")
    if settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s: anyone who can reach it can use the model", settings.host)
    uvicorn.Server(server_config(_app(settings), settings)).run()
    return 0


def _serve_on_ray(settings: Settings) -> int:
    """`--replicas N`: N engine replicas on Ray Serve behind one ingress (gateway/serve_ray)."""
    from gateway.serve_ray import require_ray

    if settings.upstreams:
        raise CliError("--replicas runs engines here; --upstream forwards to servers elsewhere: pick one")
    require_ray()
    _check_model_source(settings)
    configure_logging(settings)
    from gateway.serve_ray.launch import serve_replicas

    return serve_replicas(settings)


def _app(settings: Settings) -> Any:
    """Proxy mode when upstreams are set (no model is loaded, torch is never imported), else the model app."""
    if settings.upstreams:
        from gateway.proxy.app import create_proxy_app

        logging.getLogger("gateway").info("proxy mode: forwarding to %s", ", ".join(settings.upstreams))
        if settings.log_level != "debug":  # httpx logs every upstream call; a request's line is the proxy's own
            logging.getLogger("httpx").setLevel(logging.WARNING)
        return create_proxy_app(settings)
    from gateway.api.app import create_app

    return create_app(settings)


def _check_model_source(settings: Settings) -> None:
    """A model that cannot be found stops start-up with one line; without this the server starts,
    its background load fails with a traceback in the log, and /health says `failed`."""
    from gateway.engine.model_loader import ModelLoadError, resolve_source

    try:
        resolve_source(settings)
    except ModelLoadError as exc:
        raise CliError(str(exc)) from None


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                                "logger": record.name, "msg": record.getMessage()}
        body.update(getattr(record, "toolkv", {}))
        return json.dumps(body)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = getattr(record, "toolkv", None)
        return line + (" " + " ".join(f"{k}={v}" for k, v in extra.items()) if extra else "")


def configure_logging(settings: Settings) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(_JsonFormatter() if settings.log_json else
                         _TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())


if __name__ == "__main__":
    raise SystemExit(main())
