"""`toolkv parity` against a live tiny-model server: accuracy means nothing for a random model,
but through the cache and through the bypass its outputs must be identical, every time, with
constrained decoding on too (forced and named calls, structured outputs)."""

from __future__ import annotations

import json

import pytest

from gateway.cli.main import main
from gateway.cli.parity import RETAIL_QUERIES, STRUCTURED_QUERIES, Answer, Query, Report
from tests.conftest import WORKLOADS

RETAIL_TOOLS = WORKLOADS / "retail_16_tools.json"


@pytest.mark.parametrize("setup, tool_choice", [("chatml", "auto"), ("llama3", "auto"), ("mistral", "required"),
                                               ("chatml", "required"), ("chatml", "named"), ("llama3", "named")])
def test_parity_reports_every_output_identical(family_server, setup, tool_choice, capsys):
    live = family_server(setup)
    code = main(["parity", "--base-url", live.api_url, "--tools", str(RETAIL_TOOLS), "--limit", "5",
                 "--max-tokens", "8", "--tool-choice", tool_choice, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["num_queries"] == report["identical"] == 5
    assert report["cache_hits"] >= 4  # the first query may compute the tool group
    assert (report["model"], report["tool_choice"]) == (f"tiny-{setup}", tool_choice)
    assert report["differing"] == []


@pytest.mark.parametrize("tool_choice", ["none", "auto"])
def test_parity_with_response_format_reports_every_structured_output_identical(family_server, tool_choice, capsys):
    code = main(["parity", "--base-url", family_server("chatml").api_url, "--tools", str(RETAIL_TOOLS),
                 "--response-format", "--tool-choice", tool_choice, "--max-tokens", "8", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["num_queries"] == report["identical"] == len(STRUCTURED_QUERIES)
    assert report["response_format"] is True and report["with_tool"] == 0
    assert report["cache_hits"] >= len(STRUCTURED_QUERIES) - 1


def test_named_tool_choice_needs_queries_that_expect_a_tool(capsys):
    code = main(["parity", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--response-format",
                 "--tool-choice", "named"])
    assert code == 2
    assert "--tool-choice named needs queries that expect a tool" in capsys.readouterr().err


def test_parity_text_report_names_both_accuracies(family_server, capsys):
    code = main(["parity", "--base-url", family_server("chatml").api_url, "--tools", str(RETAIL_TOOLS),
                 "--limit", "2", "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert code == 0
    assert "identical outputs (cache vs bypass): 2/2" in out
    assert "tool-selection accuracy: cache " in out and ", bypass " in out


def test_parity_prints_a_progress_line_per_query_on_stderr(family_server, capsys):
    code = main(["parity", "--base-url", family_server("chatml").api_url, "--tools", str(RETAIL_TOOLS),
                 "--limit", "3", "--max-tokens", "4", "--json"])
    captured = capsys.readouterr()
    assert code == 0 and json.loads(captured.out)["num_queries"] == 3  # stdout stays the report alone
    lines = captured.err.splitlines()
    assert "3 queries to tiny-chatml" in lines[0]
    assert [line.split()[2] for line in lines[1:]] == ["[1/3]", "[2/3]", "[3/3]"]
    assert all(" identical: cache " in line and ", bypass " in line for line in lines[1:]), lines


def test_builtin_queries_cover_the_retail_tools():
    names = {t["function"]["name"] for t in json.loads(RETAIL_TOOLS.read_text())}
    expected = {q.expected_tool for q in RETAIL_QUERIES}
    assert len(RETAIL_QUERIES) == 20 and expected <= names and len(expected) >= 14


def test_outputs_differing_only_in_call_ids_count_as_identical():
    def response(call_id: str, arguments: str) -> dict:
        call = {"id": call_id, "type": "function", "function": {"name": "calculate", "arguments": arguments}}
        return {"choices": [{"message": {"content": None, "tool_calls": [call]}, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens_details": {"cached_tokens": 12}}}

    report = Report("m")
    query = Query("2+2?", "calculate")
    report.add(query, Answer.of(response("call_a", '{"e": "2+2"}')), Answer.of(response("call_b", '{"e": "2+2"}')))
    report.add(query, Answer.of(response("call_a", '{"e": "2+2"}')), Answer.of(response("call_a", '{"e": "4"}')))
    assert (report.identical, report.correct_cached, report.correct_bypass, report.cache_hits) == (1, 2, 2, 2)
    assert len(report.differing) == 1


def test_queries_expecting_a_tool_missing_from_the_tools_file_are_refused(tmp_path, capsys):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "only_this"}}]))
    code = main(["parity", "--base-url", "http://127.0.0.1:9/v1", "--tools", str(tools)])
    assert code == 2
    assert "expected tools not in the tools file" in capsys.readouterr().err
