"""Cache entry ids as URLs carry them: an entry's key digest (64 lowercase hex). Anything else is
rejected before it can reach the filesystem, or, on the Ray ingress, a replica. A leaf (no torch),
so the ingress checks ids exactly as a gateway does."""

from __future__ import annotations

import re

from gateway.errors import BadRequest, NotFound

ENTRY_ID = re.compile(r"[0-9a-f]{64}")


def checked_id(entry_id: str) -> str:
    if not ENTRY_ID.fullmatch(entry_id):
        raise BadRequest(f"'{entry_id[:80]}' is not a cache entry id: ids are 64 lowercase hex "
                         "characters, as listed by GET /v1/cache", param="id")
    return entry_id


def unknown_entry(digest: str) -> NotFound:
    return NotFound(f"no cache entry with id '{digest}'", param="id")
