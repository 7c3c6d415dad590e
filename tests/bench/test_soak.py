"""The soak scenario end to end through `toolkv bench` against the tiny-model server: many short
requests over several groups, the server's RSS read from its own /metrics."""

from __future__ import annotations

import contextlib
import io
import json

from gateway.bench.lab.targets import targets
from gateway.cli.main import main
from tests.support.server import LiveServer


def test_soak_reads_the_servers_rss_every_tenth_and_checks_growth(live: LiveServer, tmp_path):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["bench", "--base-url", live.base_url, "--quick", "--tools", "4", "--no-floor",
                     "--out", str(tmp_path), "--scenario", "soak"])
    assert code == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    soak = data["scenarios"]["soak"]
    assert soak["requests"] == 100 and soak["errors"] == 0 and len(soak["samples"]) == 100
    readings = [r["rss_mb"] for r in soak["rss_mb"]]
    assert len(readings) == 10 and all(mb is not None and mb > 50 for mb in readings)
    assert soak["rss_growth_mb"] == round(readings[-1] - readings[0], 1)
    assert targets(data)["rss_flat_over_soak"] in (True, False)
    assert "soak: 100 requests over 4 groups" in printed.getvalue()
