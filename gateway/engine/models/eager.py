"""The fallback for any architecture toolkv's own model does not cover: transformers' model run
eagerly, one forward per sequence of the step (so a sequence batched computes what it does
alone), its attention the torch backend over the block pool.

The one hook into transformers: an attention function registered in its `AttentionInterface`
(`toolkv_paged`), which receives the sequence's `RowKV` through the forward's keyword arguments
(transformers passes them to the attention function) and the layer from the module. Attention
that needs more than a scale and a sliding window (Gemma 2's logit softcap) is refused at load
rather than computed wrongly.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from gateway.engine.attention import torch_attention
from gateway.engine.model_runner import RowKV, StepInputs

ATTENTION_NAME = "toolkv_paged"
_ROW = "toolkv_row"


def unsupported(model: Any) -> str | None:
    """What the fallback cannot compute for `model` (None: it can run it)."""
    if getattr(model.config, "attn_logit_softcapping", None) is not None:
        return "attention logit softcapping (attn_logit_softcapping) is not implemented by toolkv's attention"
    if getattr(model, "_supports_attention_backend", True) is False:
        return "its attention cannot be replaced by toolkv's (transformers' attention interface)"
    return None


def _paged_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: `query [1, Hq, n, D]`, the sequence's new `key`/`value`
    `[1, Hk, n, D]`; returns `[1, n, Hq, D]`."""
    row: RowKV = kwargs[_ROW]
    scale = scaling if scaling is not None else query.shape[3] ** -0.5
    out = torch_attention([row], [query.shape[2]], module.layer_idx, query[0].transpose(0, 1),
                          key[0].transpose(0, 1), value[0].transpose(0, 1), scale, sliding_window)
    return out[None], None


class TransformersModel:
    """transformers' own model over the pool (`StepModel`, engine/model_runner.py)."""

    kind = "transformers"

    def __init__(self, model: Any, reason: str) -> None:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, _paged_attention)
        model.requires_grad_(False)  # autograd bookkeeping changes which kernels run
        model.set_attn_implementation(ATTENTION_NAME)
        self.model = model
        self.config = model.config
        self.reason = reason  # why toolkv's own model does not run it

    def matrices(self, head: bool) -> list[torch.Tensor] | None:
        return None  # transformers calls its own products: none are padded (the thread count stays fixed)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, step: StepInputs,
                 last: torch.Tensor | None) -> torch.Tensor:
        logits, starts = [], [0, *itertools.accumulate(step.sizes)]
        for row, start, end in zip(step.rows, starts, starts[1:], strict=False):  # one more start than rows
            keep = 1 if last is not None else 0  # the row's last token, or every token
            out = self.model(input_ids=ids[None, start:end], position_ids=positions[None, start:end],
                             use_cache=False, logits_to_keep=keep, **{_ROW: row})
            logits.append(out.logits[0])
        return torch.cat(logits)
