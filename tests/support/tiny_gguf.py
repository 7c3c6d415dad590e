"""A tiny Llama GGUF for loader tests: random weights (the embedding Q8_0-quantized, the rest
float32), two layers of width 64, and the embedded SmolLM2 GGUF's tokenizer and chat template
copied from its metadata (so transformers converts it as it converts the real one), cut to its
first 1,024 tokens and the merges that make them: a GGUF's 49,152 token strings and 48,900 merges
are parsed by gguf's reader three times a conversion (config, weights, tokenizer), ~20 s of a quiet
machine's 2 cores; the cut vocabulary (byte-level, so it still encodes any text) under 1 s. The
real vocabulary's conversion runs once a session for the default model (tests/support/models.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from tests.support.models import GGUF_NAME, smollm_package_dir

_HIDDEN, _FFN, _HEADS, _KV_HEADS, _LAYERS = 64, 128, 4, 2, 2
_VOCAB = 1024  # SmolLM2's 17 special tokens, its 256 byte tokens, and its first 751 merges' tokens


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    source = GGUFReader(str(smollm_package_dir() / GGUF_NAME))
    vocab = _VOCAB
    writer = GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 512), ("embedding_length", _HIDDEN), ("block_count", _LAYERS),
                       ("feed_forward_length", _FFN), ("attention.head_count", _HEADS),
                       ("attention.head_count_kv", _KV_HEADS), ("vocab_size", vocab),
                       ("rope.dimension_count", _HIDDEN // _HEADS)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            _copy_field(writer, name, field)
    rng = np.random.default_rng(seed)
    embedding = rng.standard_normal((vocab, _HIDDEN), dtype=np.float32) * 0.02
    writer.add_tensor("token_embd.weight", quantize(embedding, GGMLQuantizationType.Q8_0),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    for name, shape in _layer_shapes():
        values = np.ones(shape, np.float32) if name.endswith("norm.weight") else \
            rng.standard_normal(shape, dtype=np.float32) * 0.05
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _layer_shapes() -> list[tuple[str, tuple[int, ...]]]:
    head_dim = _HIDDEN // _HEADS
    shapes: list[tuple[str, tuple[int, ...]]] = [("output_norm.weight", (_HIDDEN,))]
    for i in range(_LAYERS):
        shapes += [(f"blk.{i}.attn_norm.weight", (_HIDDEN,)), (f"blk.{i}.ffn_norm.weight", (_HIDDEN,)),
                   (f"blk.{i}.attn_q.weight", (_HIDDEN, _HIDDEN)),
                   (f"blk.{i}.attn_k.weight", (_KV_HEADS * head_dim, _HIDDEN)),
                   (f"blk.{i}.attn_v.weight", (_KV_HEADS * head_dim, _HIDDEN)),
                   (f"blk.{i}.attn_output.weight", (_HIDDEN, _HIDDEN)),
                   (f"blk.{i}.ffn_gate.weight", (_FFN, _HIDDEN)), (f"blk.{i}.ffn_up.weight", (_FFN, _HIDDEN)),
                   (f"blk.{i}.ffn_down.weight", (_HIDDEN, _FFN))]
    return shapes


def _copy_field(writer: GGUFWriter, name: str, field: object) -> None:
    types = field.types  # type: ignore[attr-defined]
    parts, data = field.parts, field.data  # type: ignore[attr-defined]
    if types[0] == GGUFValueType.ARRAY:
        if types[1] == GGUFValueType.STRING:
            values = [bytes(parts[i]).decode() for i in data[:_VOCAB]]
            writer.add_array(name, _merges_within(values) if name == "tokenizer.ggml.merges" else values)
        else:
            writer.add_array(name, [parts[i].tolist()[0] for i in data[:_VOCAB]])
    elif types[0] == GGUFValueType.STRING:
        writer.add_string(name, bytes(parts[data[0]]).decode())
    elif types[0] == GGUFValueType.BOOL:
        writer.add_bool(name, bool(parts[data[0]][0]))
    else:
        writer.add_uint32(name, int(parts[data[0]][0]))


def _merges_within(merges: list[str]) -> list[str]:
    """The merges whose token is among the first `_VOCAB` (merge i makes token 273 + i)."""
    return merges[:_VOCAB - 273]
