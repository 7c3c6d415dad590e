"""Tool groups named in settings (`warm_groups`, `pinned_groups`): compiled before `/health` says ok,
so a group's first request is already a hit; those in `pinned_groups` are pinned, survive the
pressure that evicts the others, and are pinned again at the next start even in an emptied cache
dir. A file that cannot be used fails the start naming the setting and the file; a pin past the
budget leaves the group warmed, not pinned. On real servers (tiny model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from gateway.api.app import create_app
from gateway.settings import load_settings
from tests.kvcache import test_pinning as pinning
from tests.kvcache.test_pinning import BLOCK_TOKENS, GROUPS, _cached, _listed, _pressure, _tools
from tests.support.server import serve, serve_app, wait_until_ready

model, group_bytes = pinning.model, pinning.group_bytes  # the same fixtures: the tiny model, a group's bytes


def group_file(tmp_path: Path, group: int) -> Path:
    """A group as `toolkv cache warm` reads it."""
    path = tmp_path / f"group-{group}.json"
    path.write_text(json.dumps({"system": GROUPS[group], "tools": _tools(group)}))
    return path


def settings_for(model: str, cache_dir: Path, **overrides: Any) -> Any:
    return load_settings(overrides={"model": model, "min_prefix_tokens": 8, "cache_dir": str(cache_dir),
                                    "conversation_reuse": "off", "kv_block_tokens": BLOCK_TOKENS, **overrides},
                         environ={})


@contextmanager
def server(model: str, cache_dir: Path, **overrides: Any) -> Iterator[httpx.Client]:
    with serve(settings_for(model, cache_dir, **overrides)) as live, \
            httpx.Client(base_url=live.api_url, timeout=120) as api:
        yield api


def by_group(api: httpx.Client) -> dict[str, dict[str, Any]]:
    return {entry["group_id"]: entry for entry in _listed(api).values()}


def test_named_groups_are_cached_before_the_server_says_ok_and_pinned_ones_are_pinned(model: str,
                                                                                       tmp_path: Path) -> None:
    pinned, warmed = group_file(tmp_path, 0), group_file(tmp_path, 1)
    with server(model, tmp_path / "cache", pinned_groups=(str(pinned),), warm_groups=(str(warmed),),
                pinned_budget_bytes="1GiB") as api:
        listing = api.get("/cache").json()
        entries = sorted(listing["data"], key=lambda entry: not entry["pinned"])
        assert [entry["pinned"] for entry in entries] == [True, False]
        assert listing["pinned_bytes"] == entries[0]["bytes"] and listing["pinned_budget_bytes"] == 1024**3
        # each group's first request finds its whole prefix cached
        assert _cached(api, 0) == entries[0]["prefix_tokens"]
        assert _cached(api, 1) == entries[1]["prefix_tokens"]


def test_a_group_pinned_in_settings_survives_pressure_that_evicts_the_others(model: str, group_bytes: int,
                                                                              tmp_path: Path) -> None:
    with server(model, tmp_path, disk_budget_bytes=0, ram_budget_bytes=int(3.6 * group_bytes),
                pinned_budget_bytes=int(1.5 * group_bytes), pinned_groups=(str(group_file(tmp_path, 0)),),
                warm_groups=(str(group_file(tmp_path, 1)),)) as api:
        before = by_group(api)
        _pressure(api, range(2, 6))
        after = _listed(api)
        pinned_id, = (entry["id"] for entry in before.values() if entry["pinned"])
        plain_id, = (entry["id"] for entry in before.values() if not entry["pinned"])
        assert after[pinned_id]["pinned"] is True and plain_id not in after
        assert _cached(api, 0) == after[pinned_id]["prefix_tokens"]
        assert _cached(api, 1) == 0


def test_pinned_groups_are_pinned_again_after_the_cache_dir_was_emptied(model: str, tmp_path: Path) -> None:
    pinned = group_file(tmp_path, 0)
    with server(model, tmp_path / "cache", pinned_groups=(str(pinned),)) as api:
        assert api.delete("/cache").json()["deleted"] == 1  # the entry and its pin go
        assert api.get("/cache").json() == {"object": "list", "data": [], "pinned_bytes": 0,
                                            "pinned_budget_bytes": 1024**3}
    with server(model, tmp_path / "cache", pinned_groups=(str(pinned),)) as api:
        listing = api.get("/cache").json()
        assert [entry["pinned"] for entry in listing["data"]] == [True]
        assert listing["pinned_bytes"] == listing["data"][0]["bytes"]


def test_a_pin_past_the_budget_leaves_the_named_group_warmed_not_pinned(model: str, tmp_path: Path) -> None:
    with server(model, tmp_path / "cache", pinned_groups=(str(group_file(tmp_path, 0)),),
                pinned_budget_bytes=0) as api:
        entry, = _listed(api).values()
        assert entry["pinned"] is False
        assert _cached(api, 0) == entry["prefix_tokens"]


def test_a_named_file_that_cannot_be_used_fails_the_start_naming_the_setting_and_the_file(
        model: str, tmp_path: Path) -> None:
    bad = tmp_path / "tools.json"
    bad.write_text("{not json")
    for setting, path in (("pinned_groups", tmp_path / "missing.json"), ("warm_groups", bad)):
        app = create_app(settings_for(model, tmp_path / "cache", **{setting: (str(path),)}))
        with serve_app(app, wait_ready=False) as live:
            health = wait_until_ready(live.base_url)
        assert health["status"] == "failed", health
        assert f"setting '{setting}'" in health["error"] and str(path) in health["error"], health
