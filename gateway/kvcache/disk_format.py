"""The on-disk format of a cache entry: a safetensors file (no pickle anywhere) whose tensors are
`k.<layer>` / `v.<layer>` and whose header metadata holds, as JSON under `toolkv.*` keys: the
format version, the model identity, the key digest and exact prefix token ids, per-layer dtype
and shapes, the tool group, created time and a checksum. Decoding checks all of it and raises
`CacheFault` on the first thing that is wrong.

The checksum (header key `sha256`) is a sha256 over the other header fields and the CRC-32 of each
tensor's bytes, so a flipped byte anywhere in a file goes unnoticed only if it keeps its tensor's
CRC-32 (no single-bit or burst error up to 32 bits does). It guards against torn writes and bit
rot, not against someone who can write the cache dir (they could rewrite any checksum). Format 1
hashed the tensor bytes with sha256 itself: 640 ms for a 20-tool prefix (139 MB) on this CPU, most
of a restart's first request; CRC-32 takes 50 ms.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from gateway.kvcache.entry import CacheEntry, CacheIdentity, LayerKV, PrefixKey

FORMAT_VERSION = 2
_META = "toolkv."  # prefix of every header key this format writes
MapFn = Callable[[Callable[[Any], int], Iterable[Any]], Iterable[int]]


class CacheFault(Exception):
    """A disk-tier fault the caller turns into a miss (or a skipped write) plus a counter."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # a bounded metric label: corrupt, checksum, version, identity, read, write


@dataclass(frozen=True, slots=True)
class Header:
    identity: dict[str, str]  # model_fingerprint, tokenizer_fingerprint, adapter_version
    digest: str
    token_ids: tuple[int, ...]
    group_id: str
    tool_names: tuple[str, ...]
    created_at: float
    compile_s: float
    layers: tuple[dict[str, Any], ...]  # dtype, keys_shape, values_shape, cumulative_length
    sha256: str

    @property
    def kv_bytes(self) -> int:
        """The bytes of the keys and values the file holds: what the entry takes in RAM, the same
        whichever tier it is read from (the file adds its header).
        Raises ValueError/KeyError/TypeError on a malformed layer (the header is read before it
        is verified)."""
        total = 0
        for layer in self.layers:
            dtype = getattr(torch, str(layer["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {layer['dtype']!r}")
            for shape in (layer["keys_shape"], layer["values_shape"]):
                dims = [int(d) for d in shape]
                if any(d < 0 for d in dims):
                    raise ValueError(f"negative shape {dims}")
                total += math.prod(dims) * torch.empty((), dtype=dtype).element_size()
        return total

    @property
    def tensor_names(self) -> list[str]:
        return [name for i in range(len(self.layers)) for name in (f"k.{i}", f"v.{i}")]

    def to_metadata(self) -> dict[str, str]:
        fields = {**self._signed_fields(), "sha256": self.sha256}
        return {_META + name: json.dumps(value, separators=(",", ":")) for name, value in fields.items()}

    def signed(self, tensors: Iterable[torch.Tensor]) -> Header:
        """This header with its sha256 set over its other fields and `tensors`, in order."""
        return dataclasses.replace(self, sha256=self.checksum(tensors))

    def checksum(self, tensors: Iterable[torch.Tensor], map_fn: MapFn = map) -> str:
        """`map_fn` runs the CRC-32s (a thread pool's `map` checks tensors on all cores)."""
        hasher = hashlib.sha256(json.dumps(self._signed_fields(), sort_keys=True).encode())
        # Raw bytes, so any dtype (bfloat16 too) checks the same way; zlib releases the GIL.
        raw = [t.contiguous().reshape(-1).view(torch.uint8).numpy().data for t in tensors]
        for crc in map_fn(zlib.crc32, raw):
            hasher.update(crc.to_bytes(4, "little"))
        return hasher.hexdigest()

    def _signed_fields(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, "identity": self.identity, "digest": self.digest,
                "token_ids": list(self.token_ids), "group_id": self.group_id,
                "tool_names": list(self.tool_names), "created_at": self.created_at,
                "compile_s": self.compile_s, "layers": list(self.layers)}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> Header:
        """Parse a header; an old or future format is a `version` fault. Malformed fields raise
        ValueError/KeyError/TypeError, which the reader reports as `corrupt`."""
        if _META + "format" not in meta:
            raise CacheFault("corrupt", "the file has no toolkv header")
        version = json.loads(meta[_META + "format"])
        if version != FORMAT_VERSION:
            raise CacheFault("version", f"format version {version!r}; this build reads {FORMAT_VERSION}")
        def get(name: str) -> Any:
            return json.loads(meta[_META + name])

        return cls(identity={k: str(v) for k, v in get("identity").items()}, digest=str(get("digest")),
                   token_ids=tuple(int(t) for t in get("token_ids")), group_id=str(get("group_id")),
                   tool_names=tuple(str(n) for n in get("tool_names")),
                   created_at=float(get("created_at")), compile_s=float(get("compile_s")),
                   layers=tuple(dict(layer) for layer in get("layers")), sha256=str(get("sha256")))


def identity_fields(identity: CacheIdentity) -> dict[str, str]:
    """The identity a file records. The salt is not among them: it is part of the digest."""
    return {"model_fingerprint": identity.model_fingerprint,
            "tokenizer_fingerprint": identity.tokenizer_fingerprint,
            "adapter_version": identity.adapter_version}


def encode(entry: CacheEntry, identity: CacheIdentity) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (contiguous, on CPU) and header metadata to write for `entry`."""
    names = [f"{kind}.{i}" for i in range(len(entry.layers)) for kind in ("k", "v")]
    tensors = dict(zip(names, host_copies([t for layer in entry.layers for t in layer.tensors()], entry.computed),
                       strict=True))
    layers = tuple({"dtype": _dtype_name(layer.keys.dtype), "keys_shape": list(layer.keys.shape),
                    "values_shape": list(layer.values.shape), "cumulative_length": layer.cumulative_length}
                   for layer in entry.layers)
    header = Header(identity_fields(identity), entry.key.digest, entry.key.token_ids, entry.group_id,
                    entry.tool_names, entry.created_at, entry.compile_s, layers, sha256="")
    return tensors, header.signed(tensors.values()).to_metadata()


def host_copies(tensors: list[torch.Tensor], computed: Any = None) -> list[torch.Tensor]:
    """Contiguous CPU copies of `tensors`. CUDA ones are copied on the disk writer's own stream into
    pinned memory, after `computed` (an event recorded once they were; else after what the device
    has queued now): a copy on the engine's stream would hold back every step queued after it for
    the whole transfer (hundreds of MB for an 8B model's tool group), and a first transfer into
    fresh pageable memory pays its page faults there too. A strided view of the pool (one head's
    tokens are contiguous, the heads are not) is copied a contiguous piece at a time: copied whole,
    it would first be gathered into a temporary on the GPU, outside the KV pool's budget."""
    if not any(t.is_cuda for t in tensors):
        return [t.detach().to("cpu").contiguous() for t in tensors]
    device = next(t.device for t in tensors if t.is_cuda)
    stream = _copy_stream(device)
    if computed is not None:
        stream.wait_event(computed)
    else:
        stream.wait_stream(torch.cuda.current_stream(device))
    copies = []
    with torch.cuda.stream(stream):
        for tensor in tensors:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            for piece in contiguous_pieces(tensor):
                host[piece].copy_(tensor[piece].detach(), non_blocking=True)
            copies.append(host)
    stream.synchronize()
    return copies


@functools.cache
def _copy_stream(device: torch.device) -> Any:
    """One stream a device for the disk writer's copies (a new stream each time would leave what
    the allocator caches for it on up to 32 streams)."""
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch leaves it unannotated


def contiguous_pieces(tensor: torch.Tensor) -> list[tuple[int, ...]]:
    """Indexes over the fewest leading dimensions of `tensor` that leave contiguous pieces (one,
    `()`, for a contiguous tensor)."""
    lead = 0
    while lead < tensor.dim() and tensor.numel() and not tensor[(0,) * lead].is_contiguous():
        lead += 1
    return list(itertools.product(*(range(n) for n in tensor.shape[:lead])))


def check_key(header: Header, key: PrefixKey, identity: CacheIdentity) -> None:
    """The file must be this model's, and for exactly this key and these prefix tokens."""
    if header.identity != identity_fields(identity):
        raise CacheFault("identity", "the file was written for another model, tokenizer or adapter")
    if header.digest != key.digest or header.token_ids != key.token_ids:
        raise CacheFault("identity", "the file's key or prefix token ids differ from the lookup's")


def decode(header: Header, tensors: dict[str, torch.Tensor], key: PrefixKey,
           device: torch.device, map_fn: MapFn = map) -> CacheEntry:
    """The entry, after checking every tensor against the header and the checksum."""
    for i, layer in enumerate(header.layers):
        for name, shape in ((f"k.{i}", layer["keys_shape"]), (f"v.{i}", layer["values_shape"])):
            if list(tensors[name].shape) != shape or _dtype_name(tensors[name].dtype) != layer["dtype"]:
                raise CacheFault("corrupt", f"tensor {name} does not match its header")
    if header.checksum((tensors[name] for name in header.tensor_names), map_fn) != header.sha256:
        raise CacheFault("checksum", "the header or tensor bytes do not match the header's sha256")
    layers = tuple(_layer(tensors[f"k.{i}"].to(device), tensors[f"v.{i}"].to(device),
                          _optional_int(layer["cumulative_length"]))
                   for i, layer in enumerate(header.layers))
    return CacheEntry(key=key, layers=layers, group_id=header.group_id, tool_names=header.tool_names,
                      compile_s=header.compile_s, created_at=header.created_at)


def _layer(keys: torch.Tensor, values: torch.Tensor, cumulative_length: int | None) -> LayerKV:
    return LayerKV(keys, values, cumulative_length)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
