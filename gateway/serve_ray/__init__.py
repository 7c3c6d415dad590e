"""toolkv on Ray Serve (`toolkv serve --replicas N`): N engine replicas, each owning a model and its
KV pool, behind one ingress that routes each request to the replica holding its tool group.
`ray[serve]` is an optional extra; nothing here imports it at module level."""

from __future__ import annotations

import importlib.util

from gateway.cli_errors import CliError

INSTALL_HINT = 'pip install -e ".[ray]"'
APP_NAME = "toolkv"  # the Serve application
ENGINE_PREFIX = "engine-"


def engine_name(index: int) -> str:
    """The deployment (and the ingress's upstream host) of engine replica `index`."""
    return f"{ENGINE_PREFIX}{index}"


def require_ray() -> None:
    """Stop with the install command when Ray Serve is not installed."""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise CliError(f"--replicas > 1 runs on Ray Serve, which is not installed here: {INSTALL_HINT} "
                       '(or pip install "ray[serve]")')
