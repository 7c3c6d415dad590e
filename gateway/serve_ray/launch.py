"""`toolkv serve --replicas N`: join the Ray cluster at `ray_address` (or `RAY_ADDRESS`), or start
a local Ray instance sized for N engine replicas, run the Serve application on `host:port`, and
keep it until Ctrl-C or SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import threading

from gateway.settings import Settings

log = logging.getLogger(__name__)

SHUTDOWN_SLACK_S = 10.0  # beyond shutdown_grace_s, for Serve to stop its replicas


def serve_replicas(settings: Settings) -> int:
    import ray
    from ray import serve

    from gateway.serve_ray import APP_NAME
    from gateway.serve_ray.deployments import build_application

    address = settings.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:  # one logical CPU per engine (it runs torch), none for the ingress; no dashboard.
        # "local", not None: with no address Ray joins the cluster named in
        # /tmp/ray/ray_current_cluster, which a stopped `ray start --head` leaves behind.
        ray.init(address="local", num_cpus=settings.replicas, include_dashboard=False)
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        serve.run(build_application(settings, settings.replicas), name=APP_NAME, route_prefix="/")
        log.info("serving %d engine replicas on Ray Serve at http://%s:%d", settings.replicas, settings.host,
                 settings.port)
        _wait_for_stop()
    finally:
        _stop_serving(shared=bool(address), deadline_s=settings.shutdown_grace_s + SHUTDOWN_SLACK_S)
        ray.shutdown()
    return 0


def _stop_serving(shared: bool, deadline_s: float) -> None:
    """Delete the application (a shared cluster keeps its Serve instance) or shut Serve down,
    waiting at most `deadline_s`: a Ctrl-C also reaches a local instance's raylet, and Serve's
    shutdown then waits for it forever."""
    from ray import serve

    from gateway.serve_ray import APP_NAME

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
