"""What a bench report says the server ran: toolkv's version, and the device, dtype and kernel
backend, from the server's own `/version` (a toolkv that says) or, for a spawned server, from the
settings it resolves."""

from __future__ import annotations

import argparse
import importlib.metadata
from typing import Any

from gateway.settings import DEFAULT_CONFIG, load_settings


def engine_of(version: Any) -> dict[str, Any]:
    """Device, dtype and backend as the server says in `/version` (a toolkv that does), over what
    the bench resolved from its own settings; nothing for another server."""
    engine = version.get("engine") if isinstance(version, dict) else None
    if not isinstance(engine, dict):
        return {}
    graphs = ""
    if engine.get("cuda_graphs"):
        chunks = engine.get("cuda_graph_max_tokens")
        eager = engine.get("cuda_graphs_eager")
        graphs = (f", CUDA graphs (decode{f', chunk steps up to {chunks} tokens' if chunks else ''}"
                  f"{f'; {eager} failed to capture and run eagerly' if eager else ''})")
    backend = (f"{engine.get('backend')}{', fused layers' if engine.get('fused_layers') else ''}"
               f"{', batch invariant' if engine.get('batch_invariant') else ''}{graphs}"
               f"{', decode steps launched ahead' if engine.get('decode_overlap') else ''}")
    quantization = engine.get("quantization")  # bitsandbytes' nf4 or int8 weights, said beside the dtype
    dtype = engine.get("dtype") if quantization in (None, "none") else f"{engine.get('dtype')}, {quantization} weights"
    return {"device": engine.get("device"), "dtype": dtype, "backend": backend}


def server_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What the report says the run used: toolkv's version here and, for a spawned server, the
    device, dtype and attention backend it resolves its settings to (unknown for another server)."""
    out: dict[str, Any] = {"toolkv_version": _toolkv_version(), "device": None, "dtype": None, "backend": None}
    if not args.spawn:
        return out
    try:
        # lazy: the engine packages load torch, which nothing else here needs
        from gateway.engine.model_loader import pick_device, pick_dtype
        from gateway.engine.plan import engine_plan

        config = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
        settings = load_settings(config, {"model": args.model})
        device = pick_device(settings.device)
        plan = engine_plan(settings, device)
        out.update(device=str(device), dtype=str(pick_dtype(settings.dtype, device)).removeprefix("torch."),
                   backend=plan.backend + (", fused layers" if plan.fused else "")
                   + (", batch invariant" if plan.batch_invariant else ""))
    except Exception as exc:  # the report says so; the measurements stand
        out["settings_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _toolkv_version() -> str:
    try:
        return importlib.metadata.version("toolkv")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
