"""The model runner: forward passes over the block pool.

Two kinds of pass, both through the model's own transformers code with one attention function
registered in transformers' `AttentionInterface`:
- `decode(rows)`: one forward over the next token of every decoding sequence, `[B, 1]`, each row
  at its own position;
- `prefill(row, ids)`: one forward over a chunk of one sequence's prompt, `[1, n]`.

Why the output never depends on the batch (checked bitwise in tests/engine/test_batching.py):
- linear layers on a `[B, 1, in]` batch run as B matrix-vector products (`matmul` against the
  weight with a batch dimension), the very kernel a `[1, 1, in]` pass runs; a plain `F.linear`
  over `[B, in]` picks a matrix-matrix kernel whose rounding differs from one row's;
- attention runs per sequence over that sequence's own KV, in the same shapes whatever else is
  in the batch; everything else in these models is per-token.
And why it never depends on the cache: a sequence's KV is always two segments, its tool group
`[0, G)` and its own tokens after it, and prompts are prefilled in chunks whose boundaries are
fixed by position (multiples of `chunk_tokens` inside each segment). A hit, a miss and a bypass
therefore run exactly the same operations on the same numbers.

A decode step's attention reads the pool's strided views without copying them (scores per
segment, one softmax, `probs @ v` per segment); a prompt chunk's runs torch's fused SDPA over the
segments joined into one contiguous copy. Which of the two runs depends only on the chunk's
length, never on the cache or the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gateway.engine.block_pool import BlockRun

ATTENTION_NAME = "toolkv_blocks"
_ROWS_KWARG = "toolkv_rows"


@dataclass(slots=True)
class RowKV:
    """Where one sequence of a forward pass reads and writes its KV.

    `group`: per layer, the tool group's keys and values `[kv_heads, G, dim]` (read only), or None.
    `own`: the run the new tokens are written to, after its first `own_len` tokens.
    `position`: the absolute position of the first new token (= G + own_len)."""

    group: list[tuple[torch.Tensor, torch.Tensor]] | None
    own: BlockRun
    own_len: int
    position: int
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    @property
    def group_len(self) -> int:
        return self.group[0][0].shape[1] if self.group else 0

    def hidden(self, new_tokens: int, window: int | None, device: torch.device) -> torch.Tensor | None:
        """`[n, all keys]`, True where a query may not see a key (causal inside the chunk, and the
        sliding window); None when every key is visible to every query."""
        if new_tokens == 1 and (window is None or self.position < window):
            return None  # one new token sees every key (the decode step's common case: no tensors)
        if window in self._masks:
            return self._masks[window]
        total = self.group_len + self.own_len + new_tokens
        query_pos = torch.arange(self.position, self.position + new_tokens, device=device)[:, None]
        key_pos = torch.arange(total, device=device)[None, :]
        hidden = key_pos > query_pos
        if window is not None:
            hidden |= query_pos - key_pos >= window
        found = hidden if bool(hidden.any()) else None
        self._masks[window] = found
        return found


def paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None,
                    dropout: float = 0.0, sliding_window: int | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: `query [B, Hq, n, D]`, this pass's new `key`/`value`
    `[B, Hk, n, D]`; returns `[B, n, Hq, D]`. Writes the new keys/values into each row's run."""
    rows: list[RowKV] = kwargs[_ROWS_KWARG]
    layer: int = module.layer_idx  # type: ignore[assignment]
    new, dim = query.shape[2], query.shape[3]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(dim)
    outputs = []
    for b, row in enumerate(rows):
        end = row.own_len + new
        row.own.keys(layer, row.own_len, end).copy_(key[b])
        row.own.values(layer, row.own_len, end).copy_(value[b])
        segments = [*(row.group[layer:layer + 1] if row.group else ()),
                    (row.own.keys(layer, 0, end), row.own.values(layer, 0, end))]
        hidden = row.hidden(new, sliding_window, query.device)
        if new == 1:
            out = _attend_in_place(query[b], segments, hidden, scale)
        else:
            out = _attend_chunk(query[b], segments, hidden, scale)
        outputs.append(out.transpose(0, 1))
    return torch.stack(outputs), None


def _attend_in_place(query: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]],
                     hidden: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One token's attention `[Hq, 1, D]` read straight from the segments' strided views: scores
    per segment with grouped-query heads folded (KV heads are never repeated), one softmax over
    them all, `probs @ v` per segment summed in order. Nothing is copied."""
    q_heads, new, dim = query.shape
    kv_heads = segments[0][0].shape[0]
    q = query.reshape(kv_heads, (q_heads // kv_heads) * new, dim)
    scores = torch.cat([torch.matmul(q, k.transpose(1, 2)) for k, _ in segments], dim=-1) * scale
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out, offset = None, 0
    for k, v in segments:
        part = torch.matmul(probs[:, :, offset: offset + k.shape[1]], v)
        out = part if out is None else out + part
        offset += k.shape[1]
    assert out is not None
    return out.view(q_heads, new, dim)


def _attend_chunk(query: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]],
                  hidden: torch.Tensor | None, scale: float) -> torch.Tensor:
    """A prompt chunk's attention `[Hq, n, D]`: torch's fused SDPA over the segments joined into
    one contiguous copy (a chunk's scores are too big to materialize at every layer)."""
    keys = torch.cat([k for k, _ in segments], dim=1)[None]
    values = torch.cat([v for _, v in segments], dim=1)[None]
    mask = None if hidden is None else ~hidden
    out = nn.functional.scaled_dot_product_attention(query[None], keys, values, attn_mask=mask, scale=scale,
                                                     enable_gqa=True)
    return out[0]


def _rowwise_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`F.linear`, except that a batch of single tokens runs as one matrix-vector product per row."""
    if x.dim() == 3 and x.shape[1] == 1 and x.shape[0] > 1:
        y = torch.matmul(x, self.weight.t().unsqueeze(0))
        return y + self.bias if self.bias is not None else y
    return nn.functional.linear(x, self.weight, self.bias)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)


class ModelRunner:
    def __init__(self, model: Any, device: torch.device) -> None:
        _register()
        self.model = model
        self.device = device
        model.requires_grad_(False)  # autograd bookkeeping changes which kernels run
        model.config._attn_implementation = ATTENTION_NAME
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "_attn_implementation"):
                config._attn_implementation = ATTENTION_NAME
            if type(module) is nn.Linear:  # bitsandbytes' 4-bit layers keep their own forward
                module.forward = _rowwise_linear.__get__(module)  # type: ignore[method-assign]

    def decode(self, tokens: list[int], rows: list[RowKV]) -> torch.Tensor:
        """Logits `[B, vocab]` for the next token of each row, fed `tokens[b]` at its position."""
        ids = torch.tensor([[t] for t in tokens], dtype=torch.long, device=self.device)
        positions = torch.tensor([[row.position] for row in rows], dtype=torch.long, device=self.device)
        return self._forward(ids, positions, rows)[:, -1]

    def prefill(self, token_ids: list[int], row: RowKV) -> torch.Tensor:
        """Logits `[vocab]` after a chunk of one sequence's prompt."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        positions = torch.arange(row.position, row.position + len(token_ids), device=self.device)[None, :]
        return self._forward(ids, positions, [row])[0, -1]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, rows: list[RowKV]) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1,
                             **{_ROWS_KWARG: rows})
        logits: torch.Tensor = out.logits
        return logits
