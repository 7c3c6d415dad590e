"""Cache keys. An entry is valid for a prompt only if everything that determines its KV matches:
the model weights and numerics, the tokenizer and template, the adapter, and the exact prefix
token ids. The digest is sha256 over all of them (never Python's `hash()`, which is salted per
process); the token ids are also stored and compared on every hit.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

KEY_FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    """Everything but the tokens that decides what KV a prefix produces."""

    model_fingerprint: str
    tokenizer_fingerprint: str
    adapter_version: str
    salt: str = ""  # per-tenant namespace (empty: the shared namespace)

    def digest_bytes(self) -> bytes:
        blob = json.dumps(
            [KEY_FORMAT_VERSION, self.model_fingerprint, self.tokenizer_fingerprint,
             self.adapter_version, self.salt],
            separators=(",", ":"),
        )
        return blob.encode()


@dataclass(frozen=True, slots=True)
class PrefixKey:
    digest: str
    token_ids: tuple[int, ...]

    @classmethod
    def of(cls, identity: CacheIdentity, token_ids: list[int] | tuple[int, ...]) -> PrefixKey:
        ids = tuple(int(t) for t in token_ids)
        hasher = hashlib.sha256(identity.digest_bytes())
        hasher.update(b"\x00")
        hasher.update(np.asarray(ids, dtype="<i8").tobytes())
        return cls(digest=hasher.hexdigest(), token_ids=ids)

    def __len__(self) -> int:
        return len(self.token_ids)
