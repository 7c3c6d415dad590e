"""The owned models' building blocks over a flat batch `[T, hidden]`: projections called explicitly
(per sequence with `batch_invariant`), and the elementwise chains of a decoder layer each as one
kernel on CUDA (engine/triton_kernels.py) and as torch ops on the CPU:
- residual add + RMSNorm (`add_rms_norm`, transformers' rounding: the sum in the model's dtype);
- SiLU(gate) * up over the fused gate/up projection (`silu_mul`);
- attention (`PagedAttention`): q/k norm (Qwen3), RoPE, the KV write into the pool and paged
  attention over the step's metadata (engine/attention.py), one launch for decode rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from gateway.engine import attention
from gateway.engine.attention import DecodeScratch, HeadShape
from gateway.engine.model_runner import Backend, StepInputs


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, step: StepInputs) -> torch.Tensor:
    """`F.linear` of `x [T, in]` (every token of the step) or `[S, in]` (each row's last token,
    the LM head); with `step.invariant`, per sequence: decode rows as one matrix-vector product
    each, each prompt chunk as its own product (padded to `step.chunk_rows`)."""
    if not step.invariant:
        return _padded_linear(x, weight, bias, step.thread_rows)
    if x.shape[0] == step.total:
        singles, chunks = step.singles, step.sizes[step.singles:]
    elif x.shape[0] == len(step.sizes):
        singles, chunks = len(step.sizes), []
    else:
        return _padded_linear(x, weight, bias, step.thread_rows)
    parts = []
    if singles > 1:
        rows = torch.matmul(x[:singles, None, :], weight.t().unsqueeze(0))
        parts.append((rows + bias if bias is not None else rows)[:, 0])
    elif singles == 1:
        parts.append(F.linear(x[:1], weight, bias))
    offset = singles
    for size in chunks:
        parts.append(_chunk_linear(x[offset:offset + size], weight, bias, step.chunk_rows, step.thread_rows))
        offset += size
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _chunk_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  rows: tuple[int, ...], thread_rows: tuple[int, ...]) -> torch.Tensor:
    """One chunk's product, over the rows its graph alone has when that is more than its own (a
    one-token chunk alone is a decode step's single row: never padded)."""
    size = x.shape[0]
    padded = next((r for r in rows if r >= size), size) if size > 1 else size
    return _padded_linear(F.pad(x, (0, 0, 0, padded - size)) if padded > size else x, weight, bias,
                          thread_rows)[:size]


def _padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   thread_rows: tuple[int, ...]) -> torch.Tensor:
    """`F.linear`, over the next of `thread_rows` (row counts that round the same on any thread
    count) when `x`'s own count is not one of them."""
    size = x.shape[0]
    padded = next((r for r in thread_rows if r >= size), size)
    if padded == size:
        return F.linear(x, weight, bias)
    return F.linear(F.pad(x, (0, 0, 0, padded - size)), weight, bias)[:size]


class Elementwise:
    """RMSNorm (with the residual add) and SiLU * mul: torch ops, as transformers rounds them."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
        return weight * normed.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`(RMSNorm(x + residual), x + residual)`."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class TritonElementwise(Elementwise):
    """The same, one Triton kernel each (the residual updated in place). A program takes one row
    on CUDA, many under Triton's interpreter (whose cost is per program)."""

    def __init__(self) -> None:
        self.rows = 16 if attention.interpreted() else 1

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm(x, x, weight, eps, add=False)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._norm(x, residual, weight, eps, add=True), residual

    def _norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
              add: bool) -> torch.Tensor:
        out = torch.empty_like(x)
        tokens, width = x.shape
        _kernels().rms_norm[(-(-tokens // self.rows),)](x, residual, weight, out, eps, tokens, N=width,
                                                        BLOCK=_block(width), ROWS=self.rows, ADD=add)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((tokens, width), dtype=gate_up.dtype, device=gate_up.device)
        block = min(1024 // self.rows, _block(width))
        grid = (-(-tokens // self.rows), -(-width // block))
        _kernels().silu_mul[grid](gate_up, out, tokens, N=width, BLOCK=block, ROWS=self.rows)
        return out


def elementwise(backend: Backend) -> Elementwise:
    return TritonElementwise() if backend == "triton" else Elementwise()


class PagedAttention:
    """One layer's attention from its fused projection `qkv [T, (q_heads + 2 kv_heads) * D]` to
    `[T, q_heads * D]`: q/k norm, RoPE, the KV write and attention over the step's rows."""

    def __init__(self, layer: int, shape: HeadShape, backend: Backend) -> None:
        self.layer = layer
        self.shape = shape
        self.backend = backend

    def __call__(self, qkv: torch.Tensor, positions: torch.Tensor, step: StepInputs,
                 scratch: DecodeScratch | None) -> torch.Tensor:
        s = self.shape
        out = torch.empty((qkv.shape[0], s.q_heads, s.dim), dtype=qkv.dtype, device=qkv.device)
        if step.layout is not None:
            keys, values = step.pool.keys[self.layer], step.pool.values[self.layer]
            attention.attend(qkv, keys, values, step.layout, s, scratch, out)
            return out.view(qkv.shape[0], -1)
        q, k, v = torch.split(qkv.view(qkv.shape[0], -1, s.dim), [s.q_heads, s.kv_heads, s.kv_heads], dim=1)
        q, k = self._turn(q, k, positions)
        out = attention.torch_attention(step.rows, step.sizes, self.layer, q, k, v, s.scale, s.window)
        return out.reshape(qkv.shape[0], -1)

    def _turn(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q/k norm then RoPE, as transformers computes them (its tables in the model's dtype)."""
        s = self.shape
        if s.norm is not None:
            q = s.norm[0] * F.rms_norm(q.float(), (s.dim,), None, s.eps).to(q.dtype)
            k = s.norm[1] * F.rms_norm(k.float(), (s.dim,), None, s.eps).to(k.dtype)
        freqs = positions[:, None].float() * s.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = (angles.cos() * s.rope_scale).to(q.dtype)[:, None]
        sin = (angles.sin() * s.rope_scale).to(q.dtype)[:, None]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _block(width: int) -> int:
    return 1 << (width - 1).bit_length()


def _kernels() -> Any:
    from gateway.engine import triton_kernels  # lazy: Triton is optional (not installed with the CPU wheel)

    return triton_kernels
