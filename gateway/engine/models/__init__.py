"""The model a runner drives: toolkv's own for the Llama family (llama.py), transformers' eager
fallback for any other architecture (eager.py), announced in the log and on `/version`. A model
neither can compute correctly is refused at load with what is missing."""

from __future__ import annotations

import logging
from typing import Any

from gateway.engine.model_runner import Backend, StepModel
from gateway.engine.models import eager, llama
from gateway.engine.models.eager import TransformersModel
from gateway.engine.models.llama import LlamaModel

log = logging.getLogger(__name__)


class UnsupportedModel(ValueError):
    """A model neither toolkv's own model nor the transformers fallback computes correctly."""


def supports(model: Any) -> bool:
    """Whether `model` runs on toolkv's own model."""
    return llama.unsupported(model) is None


def build(model: Any, backend: Backend, owned: bool = True) -> StepModel:
    """toolkv's own model for `model` when it covers it (and `owned`), else transformers' eager."""
    why = llama.unsupported(model) if owned else "fused_layers is off"
    if why is None:
        return LlamaModel(model, backend)
    refused = eager.unsupported(model)
    if refused is not None:
        raise UnsupportedModel(f"model type {model.config.model_type!r} cannot be served: {refused}")
    log.warning("model type %r runs on transformers' eager fallback (%s): one forward per sequence, torch "
                "attention, no CUDA graphs", model.config.model_type, why)
    return TransformersModel(model, why)
