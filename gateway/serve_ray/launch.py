"""`toolkv serve --replicas N`: join the Ray cluster at `ray_address` (or `RAY_ADDRESS`), or start
a local Ray instance sized for N engine replicas, run the Serve application on `host:port`, and
keep it until Ctrl-C or SIGTERM.

Joining a cluster with token authentication: Ray 2.60's `ray start --head` turns it on whenever a
token exists (`~/.ray/auth_token`, which any earlier local `ray.init()` writes, or one named by
`RAY_AUTH_TOKEN` / `RAY_AUTH_TOKEN_PATH`), but a client given an explicit address sends its token
only under `RAY_AUTH_MODE=token`, and was refused after a minute of retries. So, as Ray does for
a cluster it finds by itself (address `auto`), toolkv turns token mode on when a token is at hand
and `RAY_AUTH_MODE` is unset; a cluster without authentication accepts the token too, and
`RAY_AUTH_MODE=disabled` opts out."""

from __future__ import annotations

import logging
import os
import signal
import threading

from gateway.cli_errors import EXIT_FAILURE, CliError
from gateway.serve_ray import APP_NAME
from gateway.settings import Settings

log = logging.getLogger(__name__)

SHUTDOWN_SLACK_S = 10.0  # beyond shutdown_grace_s, for Serve to stop its replicas


def serve_replicas(settings: Settings) -> int:
    import ray
    from ray import serve

    from gateway.serve_ray.deployments import build_application, engine_num_gpus  # lazy: imports Ray Serve

    address = settings.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        join_cluster(address)
    else:  # one logical CPU per engine (it runs torch), none for the ingress; no dashboard.
        # "local", not None: with no address Ray joins the cluster named in
        # /tmp/ray/ray_current_cluster, which a stopped `ray start --head` leaves behind.
        ray.init(address="local", num_cpus=settings.replicas, include_dashboard=False)
    try:
        try:
            gpus = engine_num_gpus(settings.device, ray.cluster_resources().get("GPU", 0.0), settings.replicas)
        except ValueError as exc:
            raise CliError(f"--replicas: {exc}", EXIT_FAILURE) from None
        serve.start(http_options={"host": settings.host, "port": settings.port})
        serve.run(build_application(settings, settings.replicas, engine_num_gpus=gpus), name=APP_NAME,
                  route_prefix="/")
        log.info("serving %d engine replicas (%s GPU each) on Ray Serve at http://%s:%d", settings.replicas,
                 gpus, settings.host, settings.port)
        _wait_for_stop()
    finally:
        _stop_serving(shared=bool(address), deadline_s=settings.shutdown_grace_s + SHUTDOWN_SLACK_S)
        ray.shutdown()
    return 0


def join_cluster(address: str) -> None:
    """Connect to the cluster at `address` (its GCS, `host:port`), with its token when one is at hand."""
    import ray

    _use_token_when_at_hand()
    try:
        ray.init(address=address)
    except (ConnectionError, ray.exceptions.AuthenticationError) as exc:
        raise CliError(f"could not join the Ray cluster at {address}: {exc}. A cluster with token authentication "
                       "needs its token here: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token "
                       "(`ray get-auth-token` on the head prints it)", EXIT_FAILURE) from None


def _use_token_when_at_hand() -> None:
    """Ray's own rule for a cluster it finds by itself (address `auto`): RAY_AUTH_MODE=token when it
    is unset and a token exists (Ray 2.60 keeps it private; a Ray without it has no token auth)."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)  # Ray logs that it did, and how to opt out


def _stop_serving(shared: bool, deadline_s: float) -> None:
    """Delete the application (a shared cluster keeps its Serve instance) or shut Serve down,
    waiting at most `deadline_s`: a Ctrl-C also reaches a local instance's raylet, and Serve's
    shutdown then waits for it forever."""
    from ray import serve

    stopper = threading.Thread(target=lambda: serve.delete(APP_NAME) if shared else serve.shutdown(),
                               name="toolkv-serve-stop", daemon=True)
    stopper.start()
    stopper.join(deadline_s)
    if stopper.is_alive():
        log.warning("Ray Serve did not stop within %.0fs; stopping Ray", deadline_s)


def _wait_for_stop() -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
