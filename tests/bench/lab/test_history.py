"""The history scenario end to end through `toolkv bench` against a tiny-model server whose KV pool
is far smaller than the history sent: records are evicted, RSS is read every tenth of the run, and
nothing fails. Its conversations share nothing but the tool group."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.bench.client import parse_metrics
from gateway.bench.lab.history import ASSISTANT_REPLY, HistoryChats
from gateway.bench.lab.targets import targets
from gateway.cli.main import main
from gateway.settings import load_settings
from tests.support.server import LiveServer, serve

POOL_BYTES = 2 * 1024**2  # 4,096 tokens of the tiny model: a group, one running turn and a few records
HISTORY_TOKENS = 20_000


@pytest.fixture(scope="module")
def small_pool(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "min_prefix_tokens": 8,
                                        "ram_budget_bytes": POOL_BYTES,
                                        "cache_dir": str(tmp_path_factory.mktemp("cache"))}, environ={})
    with serve(settings) as server:
        yield server


@pytest.fixture(scope="module")
def history(small_pool: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    out = tmp_path_factory.mktemp("history-out")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["bench", "--base-url", small_pool.base_url, "--lab", "--scenario", "history", "--no-floor",
                     "--history-tokens", str(HISTORY_TOKENS), "--history-turns", "4", "--out", str(out)])
    assert code == 0
    return json.loads((out / "bench.json").read_text()), printed.getvalue(), out


def test_history_beyond_the_pool_evicts_records_without_errors(history):
    h = history[0]["scenarios"]["history"]
    assert h["skipped"] is None and h["errors"] == 0
    assert 0 < h["pool"]["bytes"] <= POOL_BYTES and h["pool"]["tokens"] == h["pool"]["blocks"] * 16
    assert h["computed_tokens"] > h["pool"]["tokens"]  # more KV went through the pool than it holds
    assert h["conversation_evictions"] > 0
    assert h["conversation_hit_tokens"] > 0 and h["later_turns"]["record_found"] > 0


def test_history_stops_once_the_prompt_tokens_sent_reach_the_target(history):
    h = history[0]["scenarios"]["history"]
    prompts = [s["prompt_tokens"] for s in h["samples"]]
    assert h["tokens_sent"] == sum(prompts) >= HISTORY_TOKENS > sum(prompts[:-1])


def test_history_reads_the_servers_rss_every_tenth(history):
    data, printed, out = history
    h = data["scenarios"]["history"]
    readings = h["readings"]
    assert len(readings) == 10 and all(r["rss_mb"] is not None and r["rss_mb"] > 50 for r in readings)
    assert [r["tokens"] for r in readings] == sorted(r["tokens"] for r in readings)
    assert all(r["tokens"] * 10 >= HISTORY_TOKENS * k for k, r in enumerate(readings, start=1))
    assert all(0 <= r["kv_blocks_used"] <= h["pool"]["blocks"] for r in readings)
    assert h["rss_growth_mb"] == round(readings[-1]["rss_mb"] - readings[0]["rss_mb"], 1)
    assert data["targets"]["history_rss_flat"] in (True, False)
    assert "history: server RSS (MB) every 10%" in printed
    assert (out / "history.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_conversation_sends_its_turns_in_order_and_each_prompt_extends_the_last(history):
    h = history[0]["scenarios"]["history"]
    by_conversation: dict[int, list[dict[str, Any]]] = {}
    for s in h["samples"]:
        by_conversation.setdefault(s["tags"]["conversation"], []).append(s)
    assert len(by_conversation) == h["conversations"] > 1
    for turns in by_conversation.values():
        assert [s["tags"]["turn"] for s in turns] == list(range(1, len(turns) + 1))
        assert all(a["prompt_tokens"] < b["prompt_tokens"] for a, b in itertools.pairwise(turns))


def test_conversations_share_no_text_and_repeat_the_fixed_reply():
    chats = HistoryChats("run1", window=3, turns=2, words=50)
    sent = [(chat.number, [dict(m) for m in chat.messages]) for chat in (chats.next_turn() for _ in range(12))]
    numbers = {number for number, _ in sent}
    assert len(numbers) > 3  # conversations that reached 2 turns gave their place to new ones
    assert len({messages[0]["content"] for _, messages in sent}) == len(numbers)  # each opens with its own text
    for _, messages in sent:
        assert [m["role"] for m in messages] == ["user", "assistant", "user"][:len(messages)]
        assert all(m["content"] == ASSISTANT_REPLY for m in messages if m["role"] == "assistant")


def test_metrics_text_is_read_series_by_series():
    text = ('# HELP toolkv_kv_blocks KV blocks\n# TYPE toolkv_kv_blocks gauge\n'
            'toolkv_kv_blocks{state="used"} 12.0\nprocess_resident_memory_bytes 5.12e+08\nbroken line\n')
    assert parse_metrics(text) == {'toolkv_kv_blocks{state="used"}': 12.0, "process_resident_memory_bytes": 5.12e8}


def test_history_rss_is_flat_when_it_grows_by_at_most_five_percent_of_the_first_reading():
    def met(history: dict[str, Any]) -> bool | None:
        return targets({"scenarios": {"history": history}})["history_rss_flat"]

    assert met({"rss_first_mb": 500.0, "rss_growth_mb": 25.0}) is True
    assert met({"rss_first_mb": 500.0, "rss_growth_mb": 25.1}) is False
    assert met({"rss_first_mb": None, "rss_growth_mb": None}) is None
