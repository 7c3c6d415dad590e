"""The engine's plan: every switch that decides how it runs, resolved for one device and checked
together, so that `Engine` takes one object instead of a score of parameters and no combination
it does not run is ever half-applied (a switch that would be ignored is an error naming it).

The switches and what they allow:
- `backend`: "torch" anywhere; "triton" where the Triton kernels run (CUDA with Triton installed,
  or the CPU under Triton's interpreter: the test suite);
- `fused`: toolkv's own model (models/); without it the engine runs transformers' eager fallback
  on the torch backend;
- `graph_tokens` (CUDA graphs of chunk steps up to that many tokens): the Triton backend on CUDA,
  with the own model;
- `batch_invariant` and `overlap` (decode steps launched ahead): any device (on a GPU without
  captured graphs the engine turns `overlap` off at start: an eager step's launches take longer
  than its work).
`engine_plan` resolves the settings' "auto" values for the device (and the model: whether its
layers can be fused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gateway.engine import attention, models
from gateway.engine.model_runner import Backend
from gateway.errors import ModelLoadFailed
from gateway.settings import Settings


class PlanError(ValueError):
    """A combination of engine switches the engine does not run."""


@dataclass(frozen=True, slots=True)
class EnginePlan:
    """How the engine runs, resolved for `device` (module doc); checked when made."""

    device: torch.device
    backend: Backend = "torch"
    batch_invariant: bool = True
    chunk_tokens: int = 128  # at most this many prompt tokens a step (prefill_chunk_tokens)
    max_batch: int = 8
    fused: bool = False  # toolkv's own model (else transformers' eager fallback)
    overlap: bool = False  # decode steps launched one ahead (engine/decode_ahead.py)
    graph_tokens: int | None = None  # CUDA graphs, of chunk steps up to this many tokens (None: none)
    pool_bytes: int = 2 * 1024**3  # the KV block pool
    block_tokens: int = 16
    max_queue: int = 64  # jobs waiting in the engine before QueueFull
    min_prefix_tokens: int = 0  # a shorter tool group is not cached
    turn_opening: tuple[int, ...] = ()  # where prompt chunks may be cut (engine/prefix_index.py)
    conversation_reuse: bool = True  # keep a finished prompt's KV for its conversation's next turn

    def __post_init__(self) -> None:
        for name in ("chunk_tokens", "max_batch", "block_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.backend == "triton" and not attention.available(self.device):
            raise PlanError(f"the triton backend needs CUDA and Triton (pip install triton), not {self.device.type}")
        if self.graph_tokens is not None and not (
                self.backend == "triton" and self.device.type == "cuda" and self.fused):
            raise PlanError("CUDA graphs need the triton backend on CUDA with fused layers "
                            f"(backend {self.backend}, device {self.device.type}, fused {self.fused})")

    @property
    def kernels(self) -> str:
        """What decides the KV bits besides the model and the chunks, for the cache key (a chunk
        replayed from a graph runs its products over its bucket's rows)."""
        graphs = f"-graphs{self.graph_tokens}" if self.graph_tokens else ""
        return f"{self.backend}{'-owned' if self.fused else ''}{'-invariant' if self.batch_invariant else ''}{graphs}"


def engine_plan(settings: Settings, device: torch.device, model: Any = None) -> EnginePlan:
    """The plan `settings` give on `device`. `model`: the loaded model, which decides whether its
    layers can be fused (None: whether the settings ask for it). The KV pool's size and the
    template's turn opening are known later: `dataclasses.replace` them in."""
    gpu = device.type == "cuda"
    backend: Backend = "torch"
    if settings.attention_backend == "triton" or (settings.attention_backend == "auto" and gpu):
        if attention.available(device):
            backend = "triton"
        elif settings.attention_backend == "triton":
            raise ModelLoadFailed("attention_backend = triton needs CUDA and Triton (pip install triton)")
    invariant = settings.batch_invariant if settings.batch_invariant is not None else not gpu
    fused = settings.fused_layers and (model is None or models.supports(model))
    overlap = settings.decode_overlap if settings.decode_overlap is not None else gpu
    graphs = settings.cuda_graph_max_tokens if settings.cuda_graphs and backend == "triton" and gpu and fused else None
    return EnginePlan(device, backend, invariant, settings.prefill_chunk_tokens or (2048 if gpu else 128),
                      settings.max_batch or (64 if gpu else 8), fused, overlap, graphs,
                      block_tokens=settings.kv_block_tokens, max_queue=settings.max_queue,
                      min_prefix_tokens=settings.min_prefix_tokens,
                      conversation_reuse=settings.conversation_reuse == "on")
