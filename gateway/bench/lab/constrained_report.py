"""The constrained scenario's numbers: per kind, the valid share (target 100%), the finish
reasons, the first failures, tool-selection accuracy (informative: the first call's tool against
the row's, for `required`), and the grammar's cost per token against a decode step's (target: at
most 10%, lab/targets.py); the table and the summary lines."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich import box
from rich.table import Table

from gateway.bench.client import Sample

MAX_FAILURES_SHOWN = 10


def constrained_stats(samples: list[Sample], details: dict[str, Any]) -> dict[str, Any]:
    """Per kind (in the order they ran) and over all: requests, valid, finish reasons, accuracy."""
    kinds = list(dict.fromkeys(s.tags["kind"] for s in samples))
    by_kind = {kind: _kind_stats([s for s in samples if s.tags["kind"] == kind], details["cost"].get(kind, {}))
               for kind in kinds}
    sent = [s for s in samples if not s.tags.get("beyond_context")]
    valid = sum(1 for s in sent if s.tags["valid"])
    return {"by_kind": by_kind, "requests": len(sent), "valid": valid, "valid_share": _share(valid, len(sent)),
            "beyond_context": len(samples) - len(sent), "all_valid": bool(sent) and valid == len(sent),
            "failures": _failures(sent)}


def _kind_stats(samples: list[Sample], cost: dict[str, Any]) -> dict[str, Any]:
    sent = [s for s in samples if not s.tags.get("beyond_context")]
    valid = sum(1 for s in sent if s.tags["valid"])
    out: dict[str, Any] = {
        "n": len(sent), "valid": valid, "valid_share": _share(valid, len(sent)),
        "beyond_context": len(samples) - len(sent),
        "finish_reasons": dict(Counter(str(s.tags["finish_reason"]) for s in sent)),
        "completion_tokens": sum(s.completion_tokens or 0 for s in sent), "cost": cost}
    if sent and "expected_tool" in sent[0].tags:
        correct = sum(1 for s in sent if s.tags.get("tool") == s.tags["expected_tool"])
        out["tool_accuracy"] = {"correct": correct, "n": len(sent), "share": _share(correct, len(sent))}
        out["by_catalog"] = {catalog: _share(sum(1 for s in own if s.tags["valid"]), len(own))
                             for catalog in sorted({s.group.split("[")[0] for s in sent})
                             if (own := [s for s in sent if s.group.startswith(catalog + "[")])}
    return out


def _failures(samples: list[Sample]) -> list[dict[str, Any]]:
    return [{"kind": s.tags["kind"], "row": s.tags["row"], "finish_reason": s.tags["finish_reason"],
             "completion_tokens": s.completion_tokens, "calls": s.tags.get("calls"), "problem": s.tags["problem"],
             "output": s.tags.get("output")} for s in samples if not s.tags["valid"]]


def _share(count: int, total: int) -> float | None:
    return round(count / total, 4) if total else None


FINISH_CODES = {"tool_calls": "calls", "stop": "stop", "length": "LEN", "None": "none"}


def constrained_table(c: dict[str, Any]) -> Table:
    table = Table(title=f"constrained: forced calls and structured outputs (max_tokens {c['max_tokens']}"
                        + (", bounded" if c.get("bounded") else "") + ")", box=box.SIMPLE, padding=(0, 1, 0, 0),
                  caption="valid: a call to a listed (or the named) tool with schema-valid arguments, or an answer "
                          "valid for the schema, that ended by itself (LEN: cut by max_tokens); acc: first call's "
                          "tool == the row's (informative); grammar: ms per constrained token; decode: ms per "
                          "decode step")
    for column in ("kind", "n", "valid", "finish", "acc", "grammar", "decode", "share"):
        table.add_column(column, justify="left" if column in ("kind", "finish") else "right", no_wrap=True)
    rows = [*c["by_kind"].items(), ("all", {"n": c["requests"], "valid_share": c["valid_share"],
                                            "finish_reasons": {}, "cost": c["cost"].get("all", {})})]
    for kind, k in rows:
        accuracy = k.get("tool_accuracy")
        finish = " ".join(f"{FINISH_CODES.get(r, r)}:{n}" for r, n in sorted(k["finish_reasons"].items()))
        table.add_row(kind, str(k["n"]), _pct(k["valid_share"]), finish, _pct(accuracy["share"]) if accuracy else "-",
                      _num(k["cost"].get("grammar_ms_per_token"), 2), _num(k["cost"].get("decode_ms_per_step"), 1),
                      _pct(k["cost"].get("grammar_share_of_decode"), 1))
    return table


def constrained_lines(c: dict[str, Any]) -> list[str]:
    cost = c["cost"].get("all", {})
    lines = [f"constrained: {c['valid']}/{c['requests']} answers valid ({_pct(c['valid_share'])}) over "
             f"{len(c['rows'])} tool rows and {len(c['schema_rows'])} structured-output rows, max_tokens "
             f"{c['max_tokens']}; grammar {_num(cost.get('grammar_ms_per_token'), 3)} ms per constrained token "
             f"({_num(cost.get('constrained_tokens'))} tokens), decode {_num(cost.get('decode_ms_per_step'), 1)} ms "
             f"per step ({_num(cost.get('decode_steps'))} steps): {_pct(cost.get('grammar_share_of_decode'), 2)}"]
    if c["beyond_context"]:
        lines.append(f"constrained: {c['beyond_context']} requests beyond the model's context, not counted")
    lines += [f"constrained: INVALID {f['kind']} {f['row']} ({f['completion_tokens']} tokens, {f['calls']} calls): "
              f"{f['problem']}" for f in c["failures"][:MAX_FAILURES_SHOWN]]
    if len(c["failures"]) > MAX_FAILURES_SHOWN:
        lines.append(f"constrained: ... {len(c['failures']) - MAX_FAILURES_SHOWN} more invalid answers in bench.json")
    return lines


def _pct(share: float | None, digits: int = 0) -> str:
    return "-" if share is None else f"{share:.{digits}%}"


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"
