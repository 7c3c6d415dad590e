"""report.html: one page beside bench.json and the plots, to open in a browser or send to someone:
the settings the run used (memory too), the summary table, the side-by-side table when the peer
scenario ran, the findings (the console's), the checks when the lab ran (`--lab`), and the plots embedded
(data URIs, so the page stands alone). Plain HTML from the standard library's string.Template;
nothing loads from anywhere."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from html import escape
from pathlib import Path
from string import Template
from typing import Any

from gateway.bench.context import Scenario
from gateway.bench.memory import memory_text
from gateway.bench.peer_report import PEER_CAPTION, PEER_COLUMNS, peer_rows
from gateway.bench.report import SUMMARY_CAPTION, SUMMARY_COLUMNS, summary_lines, summary_rows

PAGE = Template("""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>$title</title>
<style>
body { font: 14px/1.45 system-ui, sans-serif; margin: 2rem auto; max-width: 72rem; padding: 0 1rem; color: #222; }
h1 { font-size: 1.4rem; } h2 { font-size: 1.1rem; margin-top: 2rem; }
table { border-collapse: collapse; margin: .5rem 0; }
th, td { padding: .2rem .7rem; border-bottom: 1px solid #ddd; text-align: right; white-space: nowrap; }
th:first-child, td:first-child, table.settings td, table.settings th { text-align: left; }
caption { caption-side: bottom; text-align: left; color: #666; font-size: .85rem; padding-top: .3rem; }
ul.lines { padding-left: 1.2rem; } ul.lines li { margin: .2rem 0; }
.missed { color: #b00020; font-weight: 600; } .ok { color: #2c7a2c; }
figure { margin: 1rem 0; } figure img { max-width: 100%; border: 1px solid #eee; }
code { font-size: .9em; }
</style>
</head>
<body>
<h1>$title</h1>
<h2>Settings</h2>
$settings
<h2>Summary</h2>
$summary
$peer
$lines
$checks
<h2>Plots</h2>
$plots
</body>
</html>
""")


def write_html(report: dict[str, Any], plots: list[Path], path: Path, registry: Mapping[str, Scenario]) -> Path:
    path.write_text(render(report, plots, registry), encoding="utf-8")
    return path


def render(report: dict[str, Any], plots: list[Path], registry: Mapping[str, Scenario]) -> str:
    return PAGE.substitute(
        title=escape(f"toolkv bench: {report.get('model') or 'unknown model'}"),
        settings=_settings(report), summary=_summary(report, registry), peer=_peer(report),
        lines=_lines(summary_lines(report, registry)),
        checks=_checks(report.get("checks")), plots="\n".join(_figure(p) for p in plots if p.suffix == ".png"))


def settings_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """What the run used, as (name, value): the server, its model and hardware, toolkv, the run."""
    settings = report.get("settings") or {}
    host = report.get("host") or {}
    options = report.get("options") or {}

    def known(value: Any) -> str:
        return "unknown" if value in (None, "") else str(value)

    spawned = "started by the bench (--spawn)" if report.get("spawned") else "already running"
    return [
        ("model", known(settings.get("model") or report.get("model"))),
        ("device", known(settings.get("device"))), ("dtype", known(settings.get("dtype"))),
        ("attention backend", known(settings.get("backend"))),
        ("memory (weights, KV pool, CUDA graphs)", known(memory_text(report.get("memory")))),
        ("toolkv version (bench)", known(settings.get("toolkv_version"))),
        ("server version", known(settings.get("server_version"))),
        ("server", f"{known(report.get('base_url'))}, {spawned}"),
        ("date", known(report.get("finished_at"))),
        ("duration", f"{report['duration_s']} s" if report.get("duration_s") is not None else "unknown"),
        ("command", known(report.get("command"))),
        ("run", f"{'quick, ' if options.get('quick') else ''}{known(options.get('tools'))} tools per group, "
                f"{known(options.get('max_tokens'))} tokens per answer, "
                f"tool_choice {known(options.get('tool_choice'))}"),
        ("bench host", f"{known(host.get('cpu_count'))} CPUs, {known(host.get('platform'))}, "
                       f"Python {known(host.get('python'))}"),
    ]


def _settings(report: dict[str, Any]) -> str:
    rows = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in settings_rows(report))
    return f'<table class="settings">{rows}</table>'


def _summary(report: dict[str, Any], registry: Mapping[str, Scenario]) -> str:
    rows = summary_rows(report, registry)
    if not rows:
        return "<p>No scenario timed by cache class ran; the findings are below.</p>"
    head = "".join(f"<th>{escape(c)}</th>" for c in SUMMARY_COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><caption>{escape(SUMMARY_CAPTION)}</caption><tr>{head}</tr>{body}</table>"


def _peer(report: dict[str, Any]) -> str:
    """The side-by-side table, when the peer scenario ran."""
    peer = report.get("scenarios", {}).get("peer")
    if not peer or peer.get("skipped"):
        return ""
    head = "".join(f"<th>{escape(c)}</th>" for c in PEER_COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in row) + "</tr>" for row in peer_rows(peer))
    title = f"Side by side: toolkv and the peer at {peer['peer_url']} ({peer.get('peer_model') or 'its model'})"
    return f"<h2>{escape(title)}</h2><table><caption>{escape(PEER_CAPTION)}</caption><tr>{head}</tr>{body}</table>"


def _lines(lines: list[str]) -> str:
    if not lines:
        return ""
    return '<ul class="lines">' + "".join(f"<li>{escape(line)}</li>" for line in lines) + "</ul>"


def _checks(found: list[dict[str, str]] | None) -> str:
    if found is None:
        return ""
    measured = [c for c in found if c["result"] != "not measured"]
    items = "".join(f'<li><span class="{"missed" if c["result"] == "missed" else "ok"}">{escape(c["result"])}</span> '
                    f"<code>{escape(c['name'])}</code>: {escape(c['line'])}</li>" for c in measured)
    rest = len(found) - len(measured)
    note = f"<p>{rest} targets not measured by this run's scenarios.</p>" if rest else ""
    return ("<h2>Checks (toolkv's own targets, <code>--lab</code>)</h2>"
            f'<ul class="lines">{items}</ul>{note}')


def _figure(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    name = escape(path.name)
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{name}">'
            f"<figcaption>{name}</figcaption></figure>")
