"""Fused decoder layers for the Llama family (llama, mistral, qwen2, qwen3): fewer, larger kernels.

transformers' decoder layer runs each projection as its own matrix product and RMSNorm and RoPE as
chains of elementwise ops: about 50 ops a layer for Qwen3 besides attention. On the kit's H100 a
decode step of an 8B model took 10 ms against a 4.2 ms weight-read floor, much of the difference in
those launches (docs/engine.md). `fuse` rewrites the layers of a supported model in place and
keeps transformers' model around them (the embedding, the rotary tables, the final norm, the LM
head):
- q, k and v are one product (`qkv_proj`), gate and up one (`gate_up_proj`); the old modules'
  weights become views into the fused ones, so no memory is added;
- RMSNorm is PyTorch's `F.rms_norm` (one op where the device has a fused kernel for it);
- Qwen3's per-head q and k norms are one normalization over both and one multiply;
- RoPE turns q and k together in three ops, `x * cos + flip(x) * sin`, with rotate_half's sign
  folded into the sine table once per forward (`flip` swaps the halves of each head).
About 19 ops a layer remain. The numbers differ from transformers' layers by float rounding
only (tests/engine/test_fused_layers.py); the fusion is part of the cache key (EnginePlan.kernels),
so KV computed one way is never served to the other. `unfuse` gives the model its own forwards
back (the weights stay views: the same numbers).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gateway.engine.model_runner import paged_attention

SUPPORTED = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_PATCHED = "_toolkv_fused"  # set on every module whose forward this module replaced


def supports(model: Any) -> bool:
    """Whether `model` is one `fuse` rewrites: a supported architecture with plain linear layers
    (bitsandbytes' 4-bit layers keep transformers' forwards)."""
    if getattr(model.config, "model_type", None) not in SUPPORTED:
        return False
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(inner, "rotary_emb", None) is None or not _is_norm(getattr(inner, "norm", None)):
        return False
    return all(_fusable(layer) for layer in layers)


def _is_norm(module: Any) -> bool:
    return (type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)
            and isinstance(getattr(module, "variance_epsilon", None), float))


def _fusable(layer: nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    if attn is None or mlp is None or not all(type(getattr(attn, n, None)) is nn.Linear for n in names):
        return False
    if not all(type(getattr(mlp, n, None)) is nn.Linear for n in ("gate_proj", "up_proj", "down_proj")):
        return False
    if (attn.q_proj.bias is None) != (attn.k_proj.bias is None) or (attn.k_proj.bias is None) != (
            attn.v_proj.bias is None) or (mlp.gate_proj.bias is None) != (mlp.up_proj.bias is None):
        return False
    qk_norms = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
    if any(n is not None for n in qk_norms) and not all(_is_norm(n) for n in qk_norms):
        return False
    return _is_norm(getattr(layer, "input_layernorm", None)) and _is_norm(getattr(layer, "post_attention_layernorm",
                                                                                  None))


def fuse(model: Any) -> None:
    """Rewrite the decoder layers of `model` (`supports(model)` must hold). Idempotent."""
    assert supports(model), "fuse() needs a model supports() accepts"
    inner = model.model
    config = model.config
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not hasattr(attn, "qkv_proj"):
            attn.qkv_proj = _join(attn.q_proj, attn.k_proj, attn.v_proj)
            mlp.gate_up_proj = _join(mlp.gate_proj, mlp.up_proj)
        q_heads = attn.q_proj.out_features // attn.head_dim
        kv_heads = attn.k_proj.out_features // attn.head_dim
        norm = None
        if getattr(attn, "q_norm", None) is not None:
            weight = torch.cat([attn.q_norm.weight.expand(q_heads, -1), attn.k_norm.weight.expand(kv_heads, -1)])
            norm = (weight, attn.q_norm.variance_epsilon)
        window = (getattr(config, "sliding_window", None) if config.model_type == "mistral"
                  else getattr(attn, "sliding_window", None))
        attn._toolkv_shape = (q_heads, kv_heads, norm, window)
        _patch(attn, _attention_forward)
        _patch(mlp, _mlp_forward)
        _patch(layer.input_layernorm, _norm_forward)
        _patch(layer.post_attention_layernorm, _norm_forward)
    _patch(inner.norm, _norm_forward)
    rotary = inner.rotary_emb
    dim = int(rotary.inv_freq.shape[0]) * 2
    half = dim // 2
    rotary._toolkv_sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(model.device, model.dtype)
    rotary._toolkv_inner = type(rotary).forward
    _patch(rotary, _rotary_forward)
    if model.device.type == "cuda":  # the unfused weights' memory goes back to the device
        torch.cuda.empty_cache()


def unfuse(model: Any) -> None:
    """Give every module `fuse` patched its own forward back."""
    for module in model.modules():
        if getattr(module, _PATCHED, False):
            del module.forward
            delattr(module, _PATCHED)


def is_fused(model: Any) -> bool:
    return any(getattr(module, _PATCHED, False) for module in model.modules())


def _patch(module: nn.Module, forward: Any) -> None:
    module.forward = types.MethodType(forward, module)
    setattr(module, _PATCHED, True)


def _join(*linears: nn.Linear) -> nn.Linear:
    """One linear whose output is the outputs of `linears` side by side; their weights (and biases)
    become views into its own."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    bias = torch.cat([linear.bias.detach() for linear in linears]) if linears[0].bias is not None else None
    joined = nn.Linear(linears[0].in_features, weight.shape[0], bias=bias is not None, device="meta")
    joined.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        joined.bias = nn.Parameter(bias, requires_grad=False)
    offset = 0
    for linear in linears:
        rows = linear.out_features
        linear.weight = nn.Parameter(weight[offset:offset + rows], requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias[offset:offset + rows], requires_grad=False)
        offset += rows
    return joined


def _norm_forward(self: Any, hidden: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(hidden, (hidden.shape[-1],), self.weight, self.variance_epsilon)


def _rotary_forward(self: Any, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin tables, the sine's first half negated (rotate_half's sign)."""
    cos, sin = self._toolkv_inner(self, x, position_ids)
    return cos, sin * self._toolkv_sign.to(sin.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x [1, T, heads, D]` turned: `x * cos + rotate_half(x) * sin` with `rotate_half(x)` =
    `[-x2, x1]` = `flip(x) * sign` and the sign already in `sin`."""
    flipped = x.view(*x.shape[:-1], 2, x.shape[-1] // 2).flip(-2).view(x.shape)
    return torch.addcmul(x * cos[:, :, None], flipped, sin[:, :, None])


def _attention_forward(self: Any, hidden_states: torch.Tensor,
                       position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                       attention_mask: torch.Tensor | None = None, past_key_values: Any = None,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    q_heads, kv_heads, norm, window = self._toolkv_shape
    batch, tokens = hidden_states.shape[:2]
    heads = self.qkv_proj(hidden_states).view(batch, tokens, q_heads + 2 * kv_heads, self.head_dim)
    qk, value = heads[:, :, :q_heads + kv_heads], heads[:, :, q_heads + kv_heads:]
    if norm is not None:
        weight, eps = norm
        qk = F.rms_norm(qk, (self.head_dim,), None, eps) * weight
    assert position_embeddings is not None
    cos, sin = position_embeddings
    qk = _rope(qk, cos, sin)
    query, key = qk[:, :, :q_heads], qk[:, :, q_heads:]
    out, _ = paged_attention(self, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None,
                             scaling=self.scaling, sliding_window=window, **kwargs)
    return self.o_proj(out.reshape(batch, tokens, -1)), None


def _mlp_forward(self: Any, hidden: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)  # type: ignore[no-any-return]
