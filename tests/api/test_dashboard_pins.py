"""Pinned tool groups on the dashboard, as `GET /v1/cache` counts them: `/v1/dashboard/stats` lists
which groups are pinned (with their tools, also a group that is only on disk after a restart),
the pinned bytes and pinned_budget_bytes; the page in a real headless Chromium shows them. On a
real server (tiny model)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.settings import load_settings
from tests.observability.test_dashboard_browser import Page, browser  # noqa: F401  # browser: a fixture
from tests.support.server import LiveServer, serve

SYSTEMS = ["Alpha shop assistant: answer briefly and call a tool when one fits.",
           "Bravo travel desk: answer briefly and call a tool when one fits."]
BUDGET_BYTES = 64 * 1024**2


def tools(index: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {
        "name": f"{name}_{index}", "description": f"{name.replace('_', ' ')} for desk {index}",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}}}}
        for name in ("get_order", "cancel_order")]


@contextmanager
def gateway(model_dir: Path, cache_dir: Path) -> Iterator[LiveServer]:
    settings = load_settings(overrides={"model": str(model_dir), "min_prefix_tokens": 8, "cache_dir": str(cache_dir),
                                        "pinned_budget_bytes": BUDGET_BYTES}, environ={})
    with serve(settings) as live:
        yield live


def warm(live: LiveServer, index: int, **extra: Any) -> dict[str, Any]:
    resp = httpx.post(live.api_url + "/cache/warm", json={"system": SYSTEMS[index], "tools": tools(index), **extra},
                      timeout=120)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def get(live: LiveServer, path: str) -> dict[str, Any]:
    resp = httpx.get(live.base_url + path, timeout=60)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def shown_bytes(num_bytes: float) -> str:
    """As the page writes a size (one decimal in the largest binary unit)."""
    units = ["B", "KiB", "MiB", "GiB"]
    unit = 0
    while num_bytes >= 1024 and unit < len(units) - 1:
        num_bytes, unit = num_bytes / 1024, unit + 1
    return f"{num_bytes:.1f} {units[unit]}" if unit else f"{round(num_bytes)} B"


@pytest.fixture
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama")


def test_stats_show_the_pinned_groups_bytes_and_budget_as_the_cache_listing_does(model_dir: Path,
                                                                                  tmp_path: Path) -> None:
    with gateway(model_dir, tmp_path) as live:
        pinned, plain = warm(live, 0, pin=True), warm(live, 1)
        pins = get(live, "/v1/dashboard/stats")["pins"]
        listing = get(live, "/v1/cache")
        assert (pins["pinned_bytes"], pins["pinned_budget_bytes"]) == (
            listing["pinned_bytes"], listing["pinned_budget_bytes"]) == (pinned["bytes"], BUDGET_BYTES)
        assert [(g["id"], g["group_id"], g["tool_names"], g["tier"]) for g in pins["groups"]] == [
            (pinned["id"], pinned["group_id"], pinned["tool_names"], "ram")]
        ram = {g["group_id"]: g["pinned"] for g in get(live, "/v1/dashboard/stats")["groups"]}
        assert ram == {pinned["group_id"]: True, plain["group_id"]: False}

        assert httpx.delete(f"{live.api_url}/cache/{pinned['id']}/pin", timeout=60).status_code == 200
        pins = get(live, "/v1/dashboard/stats")["pins"]
        assert (pins["pinned_bytes"], pins["groups"]) == (0, [])


def test_a_pinned_group_only_on_disk_after_a_restart_is_shown_with_its_tools(model_dir: Path,
                                                                             tmp_path: Path) -> None:
    with gateway(model_dir, tmp_path) as live:
        pinned = warm(live, 0, pin=True)
    with gateway(model_dir, tmp_path) as live:
        pins = get(live, "/v1/dashboard/stats")["pins"]
        assert [(g["id"], g["tool_names"], g["num_tokens"], g["tier"]) for g in pins["groups"]] == [
            (pinned["id"], pinned["tool_names"], pinned["prefix_tokens"], "disk")]
        assert pins["pinned_bytes"] == pinned["bytes"]


def test_the_page_shows_the_pinned_groups_and_the_budget(model_dir: Path, tmp_path: Path,
                                                         browser: Any) -> None:  # noqa: F811
    with gateway(model_dir, tmp_path) as live:
        browser.get(live.base_url + "/")
        page = Page(browser)
        page.wait_for(lambda: page.attr("status", "data-status") == "ok")
        page.wait_for(lambda: page.text("pinned-detail") == "of 64.0 MiB budget, 0 groups")
        assert page.displayed("pinned-empty")
        pinned = warm(live, 0, pin=True)
        warm(live, 1)
        size = shown_bytes(pinned["bytes"])
        page.wait_for(lambda: page.text("pinned-bytes") == size)
        assert page.text("pinned-detail") == "of 64.0 MiB budget, 1 group"
        assert not page.displayed("pinned-empty")
        assert page.table_rows("pinned-groups") == [[pinned["group_id"][:12], ", ".join(pinned["tool_names"]),
                                                     str(pinned["prefix_tokens"]), size, "ram"]]
        assert page.group_row("get_order_0")["tier"] == "ram pinned"  # "ram, pinned" (the helper drops commas)
        assert page.group_row("get_order_1")["tier"] == "ram"
