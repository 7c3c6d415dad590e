"""The constrained scenario: the BFCL-style rows of bfcl.py sent with `tool_choice: "required"` and
with the row's expected tool named, each whole and streamed; the structured-output rows sent with
`response_format` (`json_schema`, `json_object`), whole and streamed. Every answer is checked as a
client sees it (validity.py). Kinds run one after another and requests one at a time, and the
server's /metrics is read around each kind: the grammar's time per constrained token
(toolkv_constraint_seconds_total / toolkv_constrained_tokens_total) against a decode step's time
(toolkv_decode_seconds_total / toolkv_decode_steps_total), which is one token of one sequence
when nothing else runs.

`--bounded` is for random-weight test models, which write until `max_tokens` inside any string,
number or list the schema leaves open, and call tools again and again: every such string gets a
`maxLength`, every list a `maxItems`, every number a range (and becomes an integer, which is still
a JSON number), `parallel_tool_calls` is false, and the `json_object` rows (no schema to bound) are
left out.
"""

from __future__ import annotations

from typing import Any

from gateway.bench.bfcl import (
    ANSWER_SYSTEM,
    KINDS,
    SCHEMA_ROWS,
    ConstrainedRows,
    Row,
    SchemaRow,
    ToolRow,
    load_tool_rows,
    quick,
)
from gateway.bench.client import ContextTooLong, Sample
from gateway.bench.context import Context, ScenarioResult
from gateway.bench.lab.validity import Answer, StreamAssembler, answer_problem, call_problem

COST_SERIES = {"constrained_tokens": "toolkv_constrained_tokens_total",
               "grammar_s": "toolkv_constraint_seconds_total",
               "decode_steps": "toolkv_decode_steps_total", "decode_s": "toolkv_decode_seconds_total"}
BOUND_CHARS = 8
BOUND_ITEMS = 2
BOUND_RANGE = (0, 99)
EXCERPT_CHARS = 240  # of an invalid answer, kept in the report

def load_rows(*, quick_set: bool, bounded: bool) -> ConstrainedRows:
    """Every row (bfcl.py), or `--quick`'s handful; bounded for random-weight models."""
    tools, schemas = load_tool_rows(), SCHEMA_ROWS
    if quick_set:
        tools, schemas = quick(tools, schemas)
    if bounded:
        tools = tuple(_bounded_row(r) for r in tools)
        schemas = tuple(SchemaRow(r.id, r.shape, r.question, bounded_schema(r.schema))
                        for r in schemas if r.schema is not None)
    return ConstrainedRows(tools, schemas, bounded)


def _bounded_row(row: ToolRow) -> ToolRow:
    tools = tuple({**t, "function": {**t["function"], "parameters": bounded_schema(t["function"].get("parameters"))}}
                  if t["function"].get("parameters") else t for t in row.tools)
    return ToolRow(row.id, row.catalog, row.system, tools, row.offset, row.messages, row.expected_tool, row.source)


_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties")


def bounded_schema(schema: Any) -> Any:
    """`schema` with a bound on every string, list and number it leaves open (see the module doc)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded_schema(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), list):
            out[key] = [bounded_schema(sub) for sub in out[key]]
        elif key in out:
            out[key] = bounded_schema(out[key])
    if "enum" in out or "const" in out:
        return out
    types = out.get("type")
    names = set(types) if isinstance(types, list) else {types}
    if "string" in names and not {"maxLength", "pattern", "format"} & out.keys():
        out["maxLength"] = BOUND_CHARS
    if "array" in names:
        out.setdefault("maxItems", BOUND_ITEMS)
    if names & {"integer", "number"}:
        out.setdefault("minimum", BOUND_RANGE[0])
        out.setdefault("maximum", max(BOUND_RANGE[1], out["minimum"]))
        out["type"] = [("integer" if t == "number" else t) for t in types] if isinstance(types, list) else "integer"
    return out


def request_body(kind: str, row: Row, *, model: str | None, max_tokens: int, bounded: bool) -> dict[str, Any]:
    """The request of `kind` for `row`, at temperature 0."""
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "seed": 0}
    if isinstance(row, ToolRow):
        choice: Any = "required" if kind.startswith("required") else {
            "type": "function", "function": {"name": row.expected_tool}}
        body.update(messages=[{"role": "system", "content": row.system}, *row.messages], tools=list(row.tools),
                    tool_choice=choice)
        if bounded:
            body["parallel_tool_calls"] = False
    else:
        body.update(messages=[{"role": "system", "content": ANSWER_SYSTEM}, {"role": "user", "content": row.question}],
                    response_format=row.response_format)
    if kind.endswith("-stream"):
        body.update(stream=True, stream_options={"include_usage": True})
    if model:
        body["model"] = model
    return body


async def run_constrained(ctx: Context, rows: ConstrainedRows, max_tokens: int) -> ScenarioResult:
    """Each kind over its rows, one request at a time; /metrics read around each kind."""
    name = "constrained"
    result = ScenarioResult(name, details={"max_tokens": max_tokens, "bounded": rows.bounded,
                                           "rows": [_row_dict(r) for r in rows.tools],
                                           "schema_rows": [_schema_dict(r) for r in rows.schemas], "cost": {}})
    start = await ctx.client.metrics()
    for kind in KINDS:
        if not rows.of_kind(kind):
            continue
        before = await ctx.client.metrics()
        for row in rows.of_kind(kind):
            result.samples.append(await _send(ctx, kind, row, rows.bounded, max_tokens))
        result.details["cost"][kind] = grammar_cost(before, await ctx.client.metrics())
    result.details["cost"]["all"] = grammar_cost(start, await ctx.client.metrics())
    if result.details["cost"]["all"]["constrained_tokens"] is None:
        result.notes.append("the server exports no toolkv_constrained_tokens_total: the grammar's cost is unknown")
    if rows.bounded:
        result.notes.append("--bounded: open strings, lists and numbers bounded, one call per answer, "
                            "json_object rows left out")
    return result


async def _send(ctx: Context, kind: str, row: Row, bounded: bool, max_tokens: int) -> Sample:
    tools = row.tools if isinstance(row, ToolRow) else ()
    group, offset = (row.group, row.offset) if isinstance(row, ToolRow) else ("answers", 0)
    sample = Sample("constrained", group, len(tools), offset, "any", False, 0.0, tags={"kind": kind, "row": row.id})
    body = request_body(kind, row, model=ctx.workload.model, max_tokens=max_tokens,
                        bounded=bounded)
    answer: Answer | None = None
    try:
        if kind.endswith("-stream"):
            assembler = StreamAssembler()
            await ctx.client.chat(body, sample, on_chunk=assembler.feed)
            answer = assembler.answer() if sample.error is None else None
        else:
            response = await ctx.client.complete(body, sample)
            answer = Answer.of_response(response) if response is not None else None
    except ContextTooLong as exc:
        sample.error = f"beyond the model's context: {exc}"
        sample.tags["beyond_context"] = True
    sample.tags.update(verdict(kind, row, answer, sample.error))
    ctx.on_sample(sample)
    return sample


def verdict(kind: str, row: Row, answer: Answer | None, error: str | None) -> dict[str, Any]:
    """The tags a request's check leaves on its sample: valid, the problem, finish reason, the
    first call's tool against the expected one."""
    if answer is None:
        return {"valid": False, "problem": error or "no answer", "finish_reason": None}
    if isinstance(row, ToolRow):
        tools = {t["function"]["name"]: t for t in row.tools}
        named = None if kind.startswith("required") else row.expected_tool
        problem = call_problem(answer, tools, named)
        out = {"valid": problem is None, "problem": problem, "finish_reason": answer.finish_reason,
               "tool": answer.first_tool, "expected_tool": row.expected_tool, "calls": len(answer.calls)}
    else:
        problem = answer_problem(answer, row.schema)
        out = {"valid": problem is None, "problem": problem, "finish_reason": answer.finish_reason,
               "shape": row.shape}
    if problem is not None:  # what the client got, shortened
        out["output"] = _excerpt(answer)
    return out


def _excerpt(answer: Answer, chars: int = EXCERPT_CHARS) -> str:
    calls = [f"{c.get('function', {}).get('name')}({c.get('function', {}).get('arguments', '')})"
             for c in answer.calls]
    text = " ".join(filter(None, [answer.content, *calls]))
    return text if len(text) <= chars else text[:chars // 2] + f" ...[{len(text):,} chars]... " + text[-chars // 2:]


def grammar_cost(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the four counters grew by, the grammar's ms per constrained token, a decode step's ms,
    and their ratio (None where the server has no such counter or nothing was counted)."""
    grown: dict[str, Any] = {key: (after[series] - before.get(series, 0.0)) if series in after else None
                             for key, series in COST_SERIES.items()}
    grammar = _per(grown["grammar_s"], grown["constrained_tokens"])
    decode = _per(grown["decode_s"], grown["decode_steps"])
    return {"constrained_tokens": _whole(grown["constrained_tokens"]), "grammar_s": _round(grown["grammar_s"], 4),
            "decode_steps": _whole(grown["decode_steps"]), "decode_s": _round(grown["decode_s"], 3),
            "grammar_ms_per_token": _round(grammar, 4), "decode_ms_per_step": _round(decode, 3),
            "grammar_share_of_decode": _round(grammar / decode, 4) if grammar is not None and decode else None}


def _per(seconds: float | None, count: float | None) -> float | None:
    return seconds * 1000 / count if seconds is not None and count else None


def _whole(value: float | None) -> int | None:
    return None if value is None else round(value)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _row_dict(row: ToolRow) -> dict[str, Any]:
    return {"id": row.id, "catalog": row.catalog, "group": row.group, "expected_tool": row.expected_tool,
            "question": row.messages[-1]["content"], "turns": len(row.messages), "source": row.source}


def _schema_dict(row: SchemaRow) -> dict[str, Any]:
    return {"id": row.id, "shape": row.shape, "kind": row.kind, "question": row.question, "schema": row.schema}
