"""The Ray Serve application: `engine-0` ... `engine-{N-1}`, one replica each, every one owning a
model runtime and its KV pool (the model app, run in-process), and `ingress`, proxy mode's app
whose upstreams are those deployments (reached through their handles, see transport.py).

Why routing lives in the ingress and not in a Ray Serve `RequestRouter` (Ray 2.60 has the API,
at alpha stability): affinity needs a name per replica that outlives it, and a `RequestRouter`
picks among replicas of one deployment by replica ids that Ray draws anew when it restarts one;
named one-replica deployments keep `engine-1` as `engine-1`, so a restart moves no group. The
proxy app also counts a request on its replica the moment it routes it (requests arriving
together see each other; Ray's router reads queue lengths it probes from time to time), and it
already retries another replica before a stream's first event and reports hits and misses per
replica; a second implementation of the same policy inside Ray's router would have to match it.
The cost: Ray's autoscaling does not apply (`--replicas` is fixed).

This module imports no torch: the ingress never loads a model."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from ray.serve.schema import LoggingConfig
from starlette.types import ASGIApp

from gateway.logs import configure_logging
from gateway.serve_ray import engine_name
from gateway.serve_ray.asgi_call import ResponseHead, call_asgi
from gateway.settings import Settings, load_settings

CONTROL_HEADROOM = 8
MAX_AUTO_BATCH = 64  # max_batch unset: the most an engine may run (a GPU replica's default)
INGRESS_MAX_ONGOING = 1024  # Ray Serve's default (5) would cap the whole fleet at 5 requests


def replica_settings(settings: Settings) -> Settings:
    """A replica is reached only through the ingress: any Host, no upstreams, and a per-key quota
    the ingress already enforced (a replica would otherwise apply it a second time, per replica)."""
    return Settings(**{**settings.model_dump(), "upstreams": (), "allowed_hosts": ("*",),
                       "max_requests_per_key": settings.max_queue + (settings.max_batch or MAX_AUTO_BATCH)})


def engine_settings_json(settings: Settings, index: int) -> dict[str, Any]:
    """Replica `index`'s settings: the fleet's, with its own cache subdirectory when `replica_cache`
    is `separate`."""
    own = settings.model_dump(mode="json")
    if settings.replica_cache == "separate":
        own["cache_dir"] = str(Path(settings.cache_dir) / engine_name(index))
    return own


def ingress_settings(settings: Settings, replicas: int) -> Settings:
    upstreams = tuple(f"http://{engine_name(i)}" for i in range(replicas))
    return Settings(**{**settings.model_dump(), "upstreams": upstreams, "upstream_api_key": None,
                       "upstream_cache_salt": "off"})


class EngineReplica:
    """One model runtime: the model app, started here; the ingress calls `call` per request."""

    async def __init__(self, settings_json: dict[str, Any]) -> None:  # type: ignore[misc]  # Ray awaits it
        # lazy: the model app imports torch, which the ingress (and the driver declaring the app) must not
        from gateway.api.app import create_app
        from gateway.metrics import Metrics  # lazy: as above
        from gateway.serving.runtime import Runtime, build_runtime  # lazy: torch, as above

        loaded: concurrent.futures.Future[Runtime] = concurrent.futures.Future()

        def load(settings: Settings, metrics: Metrics) -> Runtime:
            try:
                runtime = build_runtime(settings, metrics)
            except BaseException as exc:
                loaded.set_exception(exc)
                raise
            loaded.set_result(runtime)
            return runtime

        settings = replica_settings(Settings(**settings_json))
        configure_replica_logging(settings)
        self.app: FastAPI = create_app(settings, load)
        self._lifespan: AbstractAsyncContextManager[Any] = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        await asyncio.wrap_future(loaded)  # ready only when the model is: a failed load fails the deployment

    async def call(self, method: str, path: str, query: bytes, headers: Sequence[tuple[bytes, bytes]],
                   body: bytes) -> AsyncIterator[ResponseHead | bytes]:
        async for item in call_asgi(self.app, method, path, query, headers, body):
            yield item

    async def __del__(self) -> None:
        lifespan = getattr(self, "_lifespan", None)  # absent when __init__ failed before it
        if lifespan is not None:
            await lifespan.__aexit__(None, None, None)  # stops the engine thread


class Ingress:
    """Proxy mode's app over the engine deployments' handles, showing them as replicas (the fleet
    view, gateway/proxy/fleet/, with the single gateway's dashboard)."""

    def __init__(self, settings_json: dict[str, Any], *engines: Any) -> None:
        self.settings = ingress_settings(Settings(**settings_json), len(engines))
        configure_replica_logging(self.settings)
        self.handles = {engine_name(i): handle for i, handle in enumerate(engines)}

    def __serve_build_asgi_app__(self) -> ASGIApp:
        # lazy: only the ingress replica builds the proxy app, never the driver that declares the application
        from gateway.api import dashboard
        from gateway.proxy.app import create_proxy_app  # lazy: as above
        from gateway.proxy.fleet.view import replica_view  # lazy: as above
        from gateway.serve_ray.transport import ForwardClientKey, ReplicaTransport  # lazy: as above

        view = replica_view(dashboard, shared_cache=self.settings.replica_cache == "shared")
        return ForwardClientKey(create_proxy_app(self.settings, ReplicaTransport(self.handles), view))


def configure_replica_logging(settings: Settings) -> None:
    """The gateway's own log format (JSON with `log_json`) and level in a Ray worker, so each
    request's INFO line carries its fields as `toolkv serve` prints them; httpx's line per call
    to a replica is left out unless debugging."""
    configure_logging(settings)
    if settings.log_level != "debug":
        logging.getLogger("httpx").setLevel(logging.WARNING)


# Plain classes above, wrapped here: mypy keeps a decorated class's own type (no `.options`/`.bind`).
# No Serve access log on the engines: every call to them is the ingress's (a request, which the
# replica's own request line reports, or a probe every upstream_probe_s), one line each otherwise.
ENGINE_DEPLOYMENT: Any = serve.deployment(num_replicas=1,
                                          logging_config=LoggingConfig(enable_access_log=False))(EngineReplica)
INGRESS_DEPLOYMENT: Any = serve.deployment(name="ingress", num_replicas=1, max_ongoing_requests=INGRESS_MAX_ONGOING,
                                           ray_actor_options={"num_cpus": 0})(serve.ingress()(Ingress))


def engine_num_gpus(device: str, cluster_gpus: float, replicas: int) -> float:
    """GPUs each engine reserves. Ray hides every GPU from an actor that reserves none (it sets
    CUDA_VISIBLE_DEVICES empty), so an engine meant for CUDA must ask: one GPU each when the
    cluster has one per engine, else an equal share (engines then share devices). `cpu`/`mps`
    reserve none; `auto` uses GPUs when the cluster has any."""
    if device in ("cpu", "mps") or cluster_gpus <= 0:
        if device == "cuda":
            raise ValueError("device is cuda, but the Ray cluster has no GPU")
        return 0.0
    return 1.0 if cluster_gpus >= replicas else round(cluster_gpus / replicas, 4)


def build_application(settings: Settings, replicas: int, engine_num_cpus: float = 1.0,
                      engine_num_gpus: float = 0.0) -> Application:
    """The Serve application for `replicas` engines behind one ingress."""
    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    settings_json = settings.model_dump(mode="json")
    # What the model app admits, plus room for the control calls (the ingress's /health probe every
    # upstream_probe_s, /metrics, /v1/cache): at saturation Ray would queue a probe behind the
    # generations, it would time out, and a busy replica would be taken for a dead one.
    max_ongoing = (settings.max_batch or MAX_AUTO_BATCH) + settings.max_queue + CONTROL_HEADROOM
    engines = [ENGINE_DEPLOYMENT.options(name=engine_name(i), max_ongoing_requests=max_ongoing,
                                     ray_actor_options={"num_cpus": engine_num_cpus, "num_gpus": engine_num_gpus})
               .bind(engine_settings_json(settings, i)) for i in range(replicas)]
    application: Application = INGRESS_DEPLOYMENT.bind(settings_json, *engines)
    return application


def app_builder(args: dict[str, Any]) -> Application:
    """For `serve run` / a Serve config file (`import_path: gateway.serve_ray.deployments:app_builder`):
    `args` holds `replicas`, optionally `config` (a TOML file), `engine_num_cpus`,
    `engine_num_gpus` (default 0: set 1 for an engine per GPU), and any setting by name;
    `TOOLKV_*` environment variables apply as for `toolkv serve`."""
    args = dict(args)
    replicas = int(args.pop("replicas", 2))
    engine_num_cpus = float(args.pop("engine_num_cpus", 1.0))
    engine_gpus = float(args.pop("engine_num_gpus", 0.0))
    settings = load_settings(args.pop("config", None), args)
    return build_application(settings, replicas, engine_num_cpus, engine_gpus)
