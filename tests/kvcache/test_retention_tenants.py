"""One key's retentions never hold another key's cache (issue 36): key A sending every group with
`prompt_cache_retention: "24h"` kept them all ahead of key B's group, which was evicted at each of
A's next groups and missed on every resend. With a retained budget shared between keys, A keeps
only its share; its older retentions are plain LRU entries, and B's group hits. On a real server
(tiny model, API keys)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.settings import load_settings
from tests.kvcache import test_pinning
from tests.kvcache.test_pinning import BLOCK_TOKENS, GROUPS, _tools
from tests.support.server import serve

model, group_bytes = test_pinning.model, test_pinning.group_bytes  # module fixtures, measured once here too
KEY_A, KEY_B, ADMIN = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789", "sk-admin-0123456789"


@pytest.fixture
def api(model: str, group_bytes: int, tmp_path: Path) -> Iterator[httpx.Client]:
    """A RAM-only server whose pool holds three groups and a request; retention may keep one
    and a half groups' bytes."""
    settings = load_settings(overrides={
        "model": model, "min_prefix_tokens": 8, "cache_dir": str(tmp_path), "conversation_reuse": "off",
        "kv_block_tokens": BLOCK_TOKENS, "disk_budget_bytes": 0, "ram_budget_bytes": int(3.6 * group_bytes),
        "retained_budget_bytes": int(1.5 * group_bytes), "api_keys": [KEY_A, KEY_B], "admin_key": ADMIN},
        environ={})
    with serve(settings) as live, httpx.Client(base_url=live.api_url, timeout=120) as client:
        yield client


def _chat(api: httpx.Client, key: str, group: int, **extra: Any) -> int:
    resp = api.post("/chat/completions", headers={"Authorization": f"Bearer {key}"}, json={
        "messages": [{"role": "system", "content": GROUPS[group]}, {"role": "user", "content": "Where is order 42?"}],
        "tools": _tools(group), "temperature": 0, "max_tokens": 2, **extra})
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_key_flooding_retained_groups_never_makes_another_keys_group_miss(api: httpx.Client) -> None:
    for group in (1, 2, 3):
        _chat(api, KEY_A, group, prompt_cache_retention="24h")
    assert _chat(api, KEY_B, 0) == 0  # computed: the pool makes room among A's groups
    for group in (4, 5):
        _chat(api, KEY_A, group, prompt_cache_retention="24h")
        assert _chat(api, KEY_B, 0) > 0  # B's resend hits between A's new groups
    listing = api.get("/cache", headers={"Authorization": f"Bearer {ADMIN}"}).json()["data"]
    retained = [e for e in listing if e["retained_until"] is not None]
    assert sum(e["bytes"] for e in retained) <= 1.5 * max(e["bytes"] for e in listing)  # A's share, no more


def test_pins_are_the_operators_a_tenants_key_cannot_pin(api: httpx.Client) -> None:
    """Retention is a tenant's, within its share; pins are only the admin key's, within
    pinned_budget_bytes: a tenant cannot buy its way past the shares with a pin."""
    _chat(api, KEY_A, 0)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    [entry] = api.get("/cache", headers=admin).json()["data"]
    for key in (KEY_A, KEY_B):
        tenant = {"Authorization": f"Bearer {key}"}
        assert api.post(f"/cache/{entry['id']}/pin", json={}, headers=tenant).status_code == 403
        warm = api.post("/cache/warm", json={"system": GROUPS[1], "tools": _tools(1), "pin": True}, headers=tenant)
        assert warm.status_code == 403
    assert api.post(f"/cache/{entry['id']}/pin", json={}, headers=admin).json()["pinned"] is True
