"""The converted weights of a GGUF model, kept: a GGUF is de-quantized (and its tokenizer rebuilt
from its metadata) on every load, ~60-110 s for the embedded SmolLM2 on 2 busy cores, where the
same weights as a safetensors directory load in seconds. The first load writes that directory;
later loads read it.

Layout: `<cache_dir>/models/<key>/` holding `config.json`, `model.safetensors`, the tokenizer's
files and `manifest.json` (written last: a directory without a readable manifest is not a copy).
The key is the GGUF's content digest (the same one the model fingerprint uses), the dtype and the
transformers version (the conversion is its code), so a changed file, dtype or release gets a copy
of its own and never a stale one. The manifest holds the key's parts and a CRC-32 of the weights
file, checked before a load: a copy that is corrupt (truncated, bits flipped, a file missing) or
names another source is removed and rebuilt, never a failed start. Writes go to a temp directory
renamed into place, so a crash leaves no half copy under a key's name (temp directories older than
an hour are swept), and two processes converting at once both end with one whole copy. At most
`MAX_COPIES` copies are kept, the least recently used removed first.

The model loaded from a copy is the one the GGUF gives, weight for weight (safetensors is exact);
`tests/engine/test_gguf_copy.py` checks the fingerprint and the outputs against a GGUF load."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gateway.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
MAX_COPIES = 4
_TEMP_PREFIX = ".tmp-"
_TEMP_MAX_AGE_S = 3600.0
_READ_BYTES = 8 * 1024**2


@dataclass(frozen=True, slots=True)
class CopyKey:
    """What decides a copy's bytes."""

    gguf_name: str
    gguf_digest: str
    dtype: str
    transformers: str

    @property
    def dirname(self) -> str:
        return f"{self.gguf_digest[:24]}-{self.dtype.removeprefix('torch.')}"


def copies_dir(cache_dir: Path) -> Path:
    return cache_dir / "models"


def find_copy(root: Path, key: CopyKey) -> Path | None:
    """The copy for `key` when one is whole and matches it; a bad one is removed (and None)."""
    folder = root / key.dirname
    if not folder.is_dir():
        return None
    problem = _check(folder, key)
    if problem is None:
        os.utime(folder / MANIFEST_FILE)  # its place in the least-recently-used order
        return folder
    log.warning("ignoring the converted copy of %s at %s (%s); converting the GGUF again", key.gguf_name, folder,
                problem)
    remove_copy(folder)
    return None


def write_copy(root: Path, key: CopyKey, model: Any, tokenizer: Tokenizer) -> Path | None:
    """Write `model`'s weights and config and `tokenizer` as a copy for `key`; None (and a warning)
    when it cannot be written: the copy is only a faster next start."""
    from safetensors.torch import save_file

    temp = root / f"{_TEMP_PREFIX}{key.dirname}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        _sweep_temps(root)
        temp.mkdir()
        save_file(_unshared_state(model), str(temp / WEIGHTS_FILE), metadata={"format": "pt"})
        model.config.save_pretrained(temp)
        tokenizer.save_pretrained(temp)
        manifest = {**asdict(key), "weights_crc32": _crc32(temp / WEIGHTS_FILE)}
        (temp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
        return _publish(temp, root / key.dirname)
    except OSError as exc:
        log.warning("cannot keep the converted weights of %s in %s (%s): the next start converts it again",
                    key.gguf_name, root, exc)
        return None
    finally:
        if temp.exists():
            remove_copy(temp)
        _trim(root, keep=key.dirname)


def _check(folder: Path, key: CopyKey) -> str | None:
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
        if not isinstance(manifest, dict):
            return "its manifest is not an object"
        if {k: manifest.get(k) for k in asdict(key)} != asdict(key):
            return "its manifest names another source"
        if manifest.get("weights_crc32") != _crc32(folder / WEIGHTS_FILE):
            return "its weights fail their checksum"
    except (OSError, ValueError) as exc:
        return f"unreadable: {exc}"
    return None


def _unshared_state(model: Any) -> dict[str, torch.Tensor]:
    """The state dict with each storage once (tied embeddings: the first name kept, as
    transformers ties the others back on load), contiguous, as safetensors requires."""
    state: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in model.state_dict().items():
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if where in seen:
            continue
        seen.add(where)
        state[name] = tensor.detach().contiguous()
    return state


def _publish(temp: Path, final: Path) -> Path:
    """Rename `temp` into place; another process that got there first keeps its copy."""
    try:
        os.rename(temp, final)
    except OSError:
        if not (final / MANIFEST_FILE).is_file():
            raise
        log.info("another process kept the converted weights at %s first", final)
    return final


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as fh:
        while block := fh.read(_READ_BYTES):
            crc = zlib.crc32(block, crc)
    return crc


def _sweep_temps(root: Path) -> None:
    """Temp directories of writers that died mid-write."""
    cutoff = time.time() - _TEMP_MAX_AGE_S
    for path in root.glob(f"{_TEMP_PREFIX}*"):
        try:
            if path.stat().st_mtime < cutoff:
                remove_copy(path)
        except OSError:
            continue


def _trim(root: Path, keep: str) -> None:
    """Remove the least recently used copies past `MAX_COPIES` (`keep` stays)."""
    def last_used(folder: Path) -> float:
        try:
            return (folder / MANIFEST_FILE).stat().st_mtime
        except OSError:
            return 0.0

    try:
        copies = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(_TEMP_PREFIX)]
    except OSError:
        return
    for folder in sorted(copies, key=last_used, reverse=True)[MAX_COPIES:]:
        if folder.name != keep:
            remove_copy(folder)


def remove_copy(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
