"""toolkv's own model for the Llama family: Llama 3.x, Mistral, Qwen2/2.5 and Qwen3 dense, in the
manner of nano-vllm's `models/qwen3.py`.

The weights come from the transformers model the loader built (from an HF directory or a GGUF):
q/k/v become one `qkv` product and gate/up one `gate_up` product, and the checkpoint's own
tensors become views into the fused ones (no memory added; the transformers model keeps working,
the tests' reference). The family differences are data: Qwen3's q/k norms, Qwen2's q/k/v bias
(any linear's bias is kept), tied embeddings (the head is the embedding's tensor), RoPE's
frequencies and scale from the checkpoint's `rope_type` (default, linear, llama3, yarn: tables
fixed at load), Mistral's and Qwen's sliding windows per layer. Weights quantized by bitsandbytes
(nf4 or int8) are fused and called the same way (models/quantized.py).

A layer, as nano-vllm's: `add_rms_norm` (the residual add of the layer before fused in), the qkv
product, attention (q/k norm, RoPE, KV write and paged attention), the o product, `add_rms_norm`,
the gate/up product, `silu_mul`, the down product. Each product is called explicitly through
`project` (per sequence with `batch_invariant`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gateway.engine.attention import DecodeScratch, HeadShape
from gateway.engine.model_runner import Backend, StepInputs
from gateway.engine.models import quantized
from gateway.engine.models.layers import PagedAttention, elementwise, project
from gateway.engine.models.quantized import Int8Linear, Nf4Linear

ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})  # inverse frequencies fixed at load


def unsupported(model: Any) -> str | None:
    """Why `model` cannot run on `LlamaModel` (None: it can)."""
    config = model.config
    if getattr(config, "model_type", None) not in ARCHITECTURES:
        return f"architecture {getattr(config, 'model_type', None)!r} is not one toolkv's own model covers"
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope not in ROPE_TYPES:
        return f"RoPE type {rope!r} changes its frequencies with the length"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    for layer in model.model.layers:
        qkv = _linears(layer.self_attn, "q_proj", "k_proj", "v_proj")
        gate_up = _linears(layer.mlp, "gate_proj", "up_proj")
        linears = [*qkv, *gate_up, *_linears(layer.self_attn, "o_proj"), *_linears(layer.mlp, "down_proj")]
        kinds = {quantized.quantization_of(linear) for linear in linears} | {quantization(model)}
        if None in kinds or len(kinds) > 1:
            return "its linear layers are neither plain nor bitsandbytes nf4 or int8 (threshold 0) layers alike"
        why = quantized.unfusable(qkv) or quantized.unfusable(gate_up)
        if why is not None:
            return why
    return None


def quantization(model: Any) -> str | None:
    """How the first layer's q projection is quantized: "none", "nf4", "int8" (None: another way)."""
    return quantized.quantization_of(getattr(model.model.layers[0].self_attn, "q_proj", None))


def _linears(module: nn.Module, *names: str) -> list[Any]:
    return [getattr(module, name, None) for name in names]


@dataclass(frozen=True, slots=True)
class Linear:
    weight: torch.Tensor
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        return project(x, self.weight, self.bias, step)

    @classmethod
    def fused(cls, *linears: nn.Linear) -> Linear:
        """One product whose output is `linears`' side by side; their weights (and biases) become
        views into its own."""
        weight = torch.cat([linear.weight.detach() for linear in linears])
        bias = torch.cat([linear.bias.detach() for linear in linears]) if linears[0].bias is not None else None
        offset = 0
        for linear in linears:
            rows = linear.out_features
            linear.weight = nn.Parameter(weight[offset:offset + rows], requires_grad=False)
            if bias is not None:
                linear.bias = nn.Parameter(bias[offset:offset + rows], requires_grad=False)
            offset += rows
        return cls(weight, bias)

    @classmethod
    def of(cls, linear: nn.Linear) -> Linear:
        return cls(linear.weight.detach(), linear.bias.detach() if linear.bias is not None else None)


Product = Linear | Nf4Linear | Int8Linear


def _product(*linears: Any) -> Product:
    """The product over `linears` side by side (one, or fused), in their quantization."""
    if quantized.quantization_of(linears[0]) != "none":
        return quantized.fused(*linears)
    return Linear.fused(*linears) if len(linears) > 1 else Linear.of(linears[0])


@dataclass(frozen=True, slots=True)
class DecoderLayer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: Product
    attention: PagedAttention
    o: Product
    gate_up: Product
    down: Product


class LlamaModel:
    """Logits at each row's last token for a flat step (`StepModel`, engine/model_runner.py)."""

    kind = "owned"

    def __init__(self, model: Any, backend: Backend) -> None:
        assert unsupported(model) is None, unsupported(model)
        model.requires_grad_(False)
        self.config = model.config
        self.backend = backend
        self.quantization = quantization(model)  # "none", "nf4" or "int8", on `/version`
        self.ops = elementwise(backend)
        inner = model.model
        self.embed = inner.embed_tokens.weight.detach()
        self.head = model.lm_head.weight.detach()  # the embedding's own tensor when they are tied
        self.norm, self.eps = inner.norm.weight.detach(), float(inner.norm.variance_epsilon)
        rotary = inner.rotary_emb
        self._inv_freq = rotary.inv_freq.detach().float()
        self._rope_scale = float(rotary.attention_scaling)
        self.layers = [self._layer(i, layer) for i, layer in enumerate(inner.layers)]
        self.shape = self.layers[0].attention.shape

    def _layer(self, index: int, layer: Any) -> DecoderLayer:
        attn, mlp = layer.self_attn, layer.mlp
        dim = attn.head_dim
        q_heads, kv_heads = attn.q_proj.out_features // dim, attn.k_proj.out_features // dim
        norm = None
        if getattr(attn, "q_norm", None) is not None:
            norm = torch.stack([attn.q_norm.weight.detach(), attn.k_norm.weight.detach()])
        window = (getattr(self.config, "sliding_window", None) if self.config.model_type == "mistral"
                  else getattr(attn, "sliding_window", None))
        shape = HeadShape(q_heads, kv_heads, dim, float(getattr(attn, "scaling", 1 / math.sqrt(dim))), window,
                          self._inv_freq, self._rope_scale, norm,
                          float(attn.q_norm.variance_epsilon) if norm is not None else 1e-6)
        return DecoderLayer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                            float(layer.input_layernorm.variance_epsilon),
                            _product(attn.q_proj, attn.k_proj, attn.v_proj),
                            PagedAttention(index, shape, self.backend), _product(attn.o_proj),
                            _product(mlp.gate_proj, mlp.up_proj), _product(mlp.down_proj))

    def matrices(self, head: bool) -> list[torch.Tensor] | None:
        """The weights of the products `project` runs over many rows, for engine/cpu_threads.invariant_rows
        to probe (`head`: the LM head's too; batch-invariant, it runs a row at a time); None when a
        product is quantized (bitsandbytes' kernels are not probed: the thread count stays fixed)."""
        linears = [linear for layer in self.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if not all(isinstance(linear, Linear) for linear in linears):
            return None
        return [*(linear.weight for linear in linears if isinstance(linear, Linear)), *([self.head] if head else [])]

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, step: StepInputs,
                 last: torch.Tensor | None) -> torch.Tensor:
        hidden = F.embedding(ids, self.embed)
        scratch = None
        if step.layout is not None and step.layout.num_decode:
            scratch = DecodeScratch(step.layout.num_decode, self.shape, hidden.device)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            if residual is None:
                hidden, residual = self.ops.rms_norm(hidden, layer.input_norm, layer.eps), hidden
            else:
                hidden, residual = self.ops.add_rms_norm(hidden, residual, layer.input_norm, layer.eps)
            hidden = layer.o(layer.attention(layer.qkv(hidden, step), positions, step, scratch), step)
            hidden, residual = self.ops.add_rms_norm(hidden, residual, layer.post_norm, layer.eps)
            hidden = layer.down(self.ops.silu_mul(layer.gate_up(hidden, step)), step)
        assert residual is not None
        if last is not None:
            hidden, residual = hidden[last], residual[last]
        hidden, _ = self.ops.add_rms_norm(hidden, residual, self.norm, self.eps)
        return project(hidden, self.head, None, step)
