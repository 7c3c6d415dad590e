"""The owned model's products over bitsandbytes' quantized weights (`quantization = "nf4"` or
`"int8"`, loaded by engine/model_loader.py through transformers' `BitsAndBytesConfig`).

Fused as the float weights are: q/k/v become one `qkv` product and gate/up one `gate_up`, and the
checkpoint's own quantized tensors become views into the fused ones (no memory added; the
transformers model keeps working, the tests' reference). Fusing changes no value: nf4's blocks of
`blocksize` weights never cross a row when a row's length is a multiple of it (checked), and
int8's scale is per row.

Each product calls bitsandbytes' own operator on the quantized weight, never a weight dequantized
by toolkv:
- nf4: `bitsandbytes::gemm_4bit`. On CUDA (bitsandbytes >= 0.50) a fused 4-bit kernel for up to
  1,536 rows, so a batched decode step reads 4-bit weights instead of dequantizing each weight
  each step; a longer prompt chunk dequantizes and runs one GEMM (compute-bound there). On the CPU
  bitsandbytes has a fused kernel only with AVX512-BF16; elsewhere (AVX2) its torch fallback
  dequantizes each weight per product: nf4 there saves memory, not time (docs/engine.md has the
  measurement).
- int8 (LLM.int8 without outliers, threshold 0): each row of activations quantized to int8 by its
  absolute maximum, an int8 x int8 product, scaled back (`bitsandbytes::int8_scaled_mm`), as
  bitsandbytes' `Linear8bitLt` computes it. On CUDA a cuBLASLt int8 GEMM; on the CPU `torch._int_mm`
  with AVX-512, else a float32 product of the int8 values.
With `batch_invariant`, each decode row and each prompt chunk is its own product (as the float
products are), so a row's result never depends on the rows beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gateway.engine.model_runner import StepInputs

QUANTIZATIONS = ("nf4", "int8")


def quantization_of(linear: Any) -> str | None:
    """"nf4" or "int8" for a bitsandbytes layer the owned model runs, "none" for a plain
    `nn.Linear`, None for anything else."""
    if type(linear) is torch.nn.Linear:
        return "none"
    kind = type(linear).__name__
    state = getattr(getattr(linear, "weight", None), "quant_state", None)
    if kind == "Linear4bit" and state is not None and state.quant_type == "nf4":
        return "nf4"
    if kind == "Linear8bitLt" and linear.weight.dtype == torch.int8 and linear.state.threshold == 0.0:
        return "int8"
    return None


def unfusable(linears: list[Any]) -> str | None:
    """Why these layers (all of one quantization) cannot be one fused product (None: they can)."""
    first = linears[0]
    if quantization_of(first) != "nf4":
        return None
    for linear in linears:
        state = linear.weight.quant_state
        if state.nested or getattr(state, "packing_format_for_cpu", False):
            return "its 4-bit weights are double-quantized or repacked for the CPU"
        if linear.in_features % state.blocksize or state.blocksize != first.weight.quant_state.blocksize:
            return f"a row of {linear.in_features} weights is not whole nf4 blocks of {state.blocksize}"
    return None


@dataclass(frozen=True, slots=True)
class Nf4Linear:
    """`x @ W.T + b` with W in bitsandbytes' nf4: `packed` two weights a byte, row after row, and
    `absmax` the scale of each block of `blocksize` weights."""

    packed: torch.Tensor  # uint8 [out * in / 2, 1]
    absmax: torch.Tensor  # float32 [out * in / blocksize]
    shape: tuple[int, int]  # (out, in)
    blocksize: int
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        return per_sequence(x, step, self._product)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.bitsandbytes.gemm_4bit.default(x, self.packed, list(self.shape), self.absmax,
                                                      self.blocksize, "nf4", bias=self.bias)
        return out.to(x.dtype)  # type: ignore[no-any-return]

    @classmethod
    def fused(cls, *linears: Any) -> Nf4Linear:
        """One product over `linears` side by side; their packed weights, scales and biases
        become views into its own."""
        states = [linear.weight.quant_state for linear in linears]
        packed = torch.cat([linear.weight.data.reshape(-1) for linear in linears]).unsqueeze(1)
        absmax = torch.cat([state.absmax for state in states])
        bias = _fused_bias(linears)
        offset = absmax_offset = 0
        for linear, state in zip(linears, states, strict=True):
            size, blocks = linear.weight.data.numel(), state.absmax.numel()
            linear.weight.data = packed[offset:offset + size]
            state.absmax = absmax[absmax_offset:absmax_offset + blocks]
            offset, absmax_offset = offset + size, absmax_offset + blocks
        out = sum(linear.out_features for linear in linears)
        return cls(packed, absmax, (out, linears[0].in_features), states[0].blocksize, bias)


@dataclass(frozen=True, slots=True)
class Int8Linear:
    """`x @ W.T + b` with W as bitsandbytes' int8 rows `codes` and each row's absolute maximum
    `scales` (W ~= codes * scales / 127)."""

    codes: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # float32 [out]
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        return per_sequence(x, step, self._product)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.bitsandbytes
        # fp16 before quantizing, as Linear8bitLt does (its rows' maxima are fp16 values)
        rows, row_scales, _ = ops.int8_vectorwise_quant.default(x.to(torch.float16), 0.0)
        return ops.int8_scaled_mm.default(rows, self.codes, row_scales, self.scales,  # type: ignore[no-any-return]
                                          bias=self.bias, dtype=x.dtype)

    @classmethod
    def fused(cls, *linears: Any) -> Int8Linear:
        """One product over `linears` side by side; their int8 rows, scales and biases become
        views into its own."""
        codes = torch.cat([linear.weight.data for linear in linears])
        scales = torch.cat([_int8_scales(linear) for linear in linears])
        bias = _fused_bias(linears)
        offset = 0
        for linear in linears:
            rows = linear.out_features
            linear.weight.data = codes[offset:offset + rows]
            for holder in (linear.weight, linear.state):  # Linear8bitLt moves them on its first forward
                if getattr(holder, "SCB", None) is not None:
                    holder.SCB = scales[offset:offset + rows]
                if getattr(holder, "CB", None) is not None:
                    holder.CB = codes[offset:offset + rows]
            offset += rows
        return cls(codes, scales, bias)


def fused(*linears: Any) -> Nf4Linear | Int8Linear:
    """The quantized product over `linears` (one bitsandbytes quantization, `unfusable` None)."""
    return Nf4Linear.fused(*linears) if quantization_of(linears[0]) == "nf4" else Int8Linear.fused(*linears)


def per_sequence(x: torch.Tensor, step: StepInputs, product: Any) -> torch.Tensor:
    """`product(x)`; with `step.invariant`, each decode row and each prompt chunk alone."""
    if not step.invariant or x.shape[0] not in (step.total, len(step.sizes)):
        return product(x)  # type: ignore[no-any-return]
    sizes = [1] * step.singles + list(step.sizes[step.singles:]) if x.shape[0] == step.total else \
        [1] * len(step.sizes)
    if len(sizes) == 1:
        return product(x)  # type: ignore[no-any-return]
    return torch.cat([product(part) for part in torch.split(x, sizes)])


def _int8_scales(linear: Any) -> torch.Tensor:
    scales = linear.weight.SCB if getattr(linear.weight, "SCB", None) is not None else linear.state.SCB
    return scales  # type: ignore[no-any-return]


def _fused_bias(linears: tuple[Any, ...]) -> torch.Tensor | None:
    if linears[0].bias is None:
        return None
    bias = torch.cat([linear.bias.detach() for linear in linears])
    offset = 0
    for linear in linears:
        rows = linear.out_features
        linear.bias = torch.nn.Parameter(bias[offset:offset + rows], requires_grad=False)
        offset += rows
    return bias
