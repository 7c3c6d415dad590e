"""Cache keys change with everything that decides the KV, and are stable across processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gateway.kvcache.entry import CacheIdentity, PrefixKey

pytestmark = pytest.mark.model_free  # no model, no server: in the fast subset

BASE = CacheIdentity("model-a", "tok-a", "chatml-1")
IDS = [1, 2, 3, 4]


def test_key_changes_with_model_tokenizer_adapter_salt_and_tokens():
    base = PrefixKey.of(BASE, IDS).digest
    variants = [
        PrefixKey.of(CacheIdentity("model-b", "tok-a", "chatml-1"), IDS),
        PrefixKey.of(CacheIdentity("model-a", "tok-b", "chatml-1"), IDS),
        PrefixKey.of(CacheIdentity("model-a", "tok-a", "chatml-2"), IDS),
        PrefixKey.of(CacheIdentity("model-a", "tok-a", "chatml-1", salt="tenant"), IDS),
        PrefixKey.of(BASE, [1, 2, 3, 5]),
        PrefixKey.of(BASE, [1, 2, 3]),
    ]
    assert all(v.digest != base for v in variants)
    assert len({v.digest for v in variants}) == len(variants)


def test_digest_is_stable_across_processes():
    code = ("from gateway.kvcache.entry import CacheIdentity, PrefixKey;"
            "print(PrefixKey.of(CacheIdentity('model-a','tok-a','chatml-1'), [1,2,3,4]).digest)")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == PrefixKey.of(BASE, IDS).digest
