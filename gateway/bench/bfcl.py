"""BFCL-style rows for the constrained scenario and `toolkv parity`: a tool catalog (or a slice of
one), the messages of a user who needs a tool, and the tool; plus structured-output rows (a
question and the JSON schema its answer must follow).

Where each row comes from (nothing here is generated; every label is written down below):
- merchant (merchant_100_tools.json, 100 tools, ~13k tokens: more than a small model's context):
  the 10 `merchant_analytics` questions recorded in contextcache/queries_openai.jsonl (the file
  records no call for them: the tool is our label, by the tool's name and description), and 10
  questions written here from one tool's description each. A row sends the 20-tool slice of the
  catalog that holds its tool (tools 0-19, 20-39, ...; ~2,400-2,800 tokens).
- retail (retail_16_tools.json, all 16 tools): the 20 questions of `toolkv parity`'s built-in
  set, written per tool from its description with ids from tau-bench's retail tasks.
- airline (tau_bench/tools_airline.json, all 14 tools, behind the domain's policy as the system
  message): one row per recorded conversation of the trajectory file (trial 0: 22 of them). The
  messages are the conversation up to the agent's first call, and the tool is that call's. The
  first user turn alone rarely names the user or the reservation; the turns up to the call do.

The structured-output rows cover the shapes a schema takes: enums, a nested object, an array of
objects, integer ranges, a mix of them; string fields carry a `maxLength` or a `pattern`, as a
real form would. `json_object` rows have no schema: the answer only has to be a JSON object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.bench.data import WORKLOADS as WORKLOADS  # re-exported: `toolkv parity` reads it

MERCHANT_SLICE = 20  # tools per merchant row: the slice that holds the row's tool

MERCHANT_SYSTEM = ("You are the back-office assistant of an online merchant. Answer briefly; "
                   "call a tool when it helps.")
RETAIL_SYSTEM = ("You are a customer service agent for an online retail store. Help the user with "
                 "their orders, returns, exchanges and account, using the tools when they are needed.")
ANSWER_SYSTEM = "You are a helpful assistant. Answer with JSON only."

# contextcache's recorded merchant_analytics questions -> the tool that answers each (our label).
MERCHANT_RECORDED_LABELS = {
    "What's my GMV this month?": "gmv_summary",
    "Which products are selling the most this week?": "top_products",
    "Show me my customer retention rate for the last quarter": "customer_retention",
    "What's my cart abandonment rate?": "cart_abandonment",
    "How are my delivery partners performing?": "delivery_partner_performance",
    "What's my return rate and what are the top reasons?": "return_rate",
    "Show me revenue by geography at state level for this month": "revenue_by_geography",
    "What's my ad spend ROI across all channels?": "ad_spend_roi",
    "Which products are out of stock and how much revenue am I losing?": "out_of_stock",
    "What's my profit margin by category this quarter?": "profit_margin",
}
# Written here, one per tool, from the tool's description (two or three per 20-tool slice).
MERCHANT_WRITTEN = (
    ("Forecast our revenue for the next 30 days with the seasonal model.", "revenue_forecast"),
    ("What is the current status of order ORD-2026-8891234?", "order_status"),
    ("Summarise refunds and chargebacks for defective items from 2026-01-01 to 2026-01-31.", "refund_summary"),
    ("List the orders delayed by more than 3 days with carrier BlueDart.", "delayed_orders"),
    ("Which products sold fewer than 5 units in the last 60 days?", "slow_movers"),
    ("What is our customer churn rate over the last 90 days, with the customers at risk?", "churn_rate"),
    ("Who are our top 10 customers by lifetime value?", "top_customers"),
    ("Which products have had no sales for 120 days? Include their stock value.", "dead_stock"),
    ("How is supplier SUP-118 doing on delivery time this quarter?", "supplier_performance"),
    ("How much GST did we collect between 2026-01-01 and 2026-03-31?", "tax_summary"),
)
RETAIL_QUESTIONS = (
    ("My email is noah.brown7@example.com, can you find my account?", "find_user_id_by_email"),
    ("I'm Yusuf Rossi and my zip code is 19122. Please look up my user id.", "find_user_id_by_name_zip"),
    ("What's the status of my order #W2378156?", "get_order_details"),
    ("Show me the profile and the orders of user yusuf_rossi_9620.", "get_user_details"),
    ("What kinds of products do you sell?", "list_all_product_types"),
    ("What options and prices are available for product 6086499569?", "get_product_details"),
    ("Please cancel my pending order #W5918442, I ordered it by mistake.", "cancel_pending_order"),
    ("I want to return item 4068787148 from my delivered order #W7273336, refund to credit_card_9513926.",
     "return_delivered_order_items"),
    ("Exchange item 2768401027 in delivered order #W6390527 for item 7533802601, paying with paypal_4238515.",
     "exchange_delivered_order_items"),
    ("Ship pending order #W4860251 to 445 Maple Drive, Suite 394, Fort Worth, TX, USA 76165 instead.",
     "modify_pending_order_address"),
    ("In pending order #W1092119 swap item 8470360507 for item 5339029584, using gift_card_7245904.",
     "modify_pending_order_items"),
    ("Please charge paypal_3024827 instead of my card for pending order #W3823200.",
     "modify_pending_order_payment"),
    ("Change the default address of user mei_kovacs_8020 to 317 Elm Street, Apt 2, Denver, CO, USA 80202.",
     "modify_user_address"),
    ("What is 149.99 * 3 - 20?", "calculate"),
    ("I want to talk to a real person, not a bot.", "transfer_to_human_agents"),
    ("Find the user whose email is sofia.rossi2645@example.com.", "find_user_id_by_email"),
    ("Has my order #W9711842 shipped yet?", "get_order_details"),
    ("Which variants of product 9523456873 are in stock?", "get_product_details"),
    ("Cancel order #W8665881, I no longer need it.", "cancel_pending_order"),
    ("Add up 45.50 + 19.99 + 7.25 for me.", "calculate"),
)


class RowsError(ValueError):
    """A workload file is missing or does not hold what the rows are built from."""


@dataclass(frozen=True, slots=True)
class ToolRow:
    """One question that needs one tool of `tools`."""

    id: str  # e.g. "retail-03"
    catalog: str  # merchant | retail | airline
    system: str
    tools: tuple[dict[str, Any], ...]
    offset: int  # index of the first tool in the catalog
    messages: tuple[dict[str, Any], ...]  # after the system message; the last is the user's
    expected_tool: str
    source: str  # where the question comes from

    @property
    def group(self) -> str:
        return f"{self.catalog}[{self.offset}:{self.offset + len(self.tools)}]"

    def tool(self, name: str) -> dict[str, Any] | None:
        return next((t for t in self.tools if t["function"]["name"] == name), None)


@dataclass(frozen=True, slots=True)
class SchemaRow:
    """A question whose answer is JSON: valid for `schema`, or any object (`json_object`)."""

    id: str
    shape: str  # enum | nested | array | integer-range | mixed | json_object
    question: str
    schema: dict[str, Any] | None  # None: json_object

    @property
    def kind(self) -> str:
        return "json_object" if self.schema is None else "json_schema"

    @property
    def response_format(self) -> dict[str, Any]:
        if self.schema is None:
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": self.id.replace("-", "_"), "schema": self.schema}}


# The constrained scenario's request kinds: tool rows are sent four ways, schema rows by their kind.
TOOL_KINDS = ("required", "named", "required-stream", "named-stream")
SCHEMA_KINDS = ("json_schema", "json_schema-stream", "json_object", "json_object-stream")
KINDS = TOOL_KINDS + SCHEMA_KINDS

Row = ToolRow | SchemaRow


@dataclass(frozen=True, slots=True)
class ConstrainedRows:
    """The rows the constrained scenario sends (constrained.load_rows)."""

    tools: tuple[ToolRow, ...]
    schemas: tuple[SchemaRow, ...]
    bounded: bool = False

    def of_kind(self, kind: str) -> tuple[Row, ...]:
        if kind in TOOL_KINDS:
            return self.tools
        return tuple(r for r in self.schemas if kind.removesuffix("-stream") == r.kind)

    @property
    def num_requests(self) -> int:
        return sum(len(self.of_kind(kind)) for kind in KINDS)


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties)}


def _text(max_length: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


def _count(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


SCHEMA_ROWS: tuple[SchemaRow, ...] = (
    SchemaRow("schema-enum", "enum", "Classify this review by sentiment and topic: 'The espresso machine "
              "broke after two days and support never answered my emails.'",
              _object({"sentiment": {"type": "string", "enum": ["positive", "neutral", "negative"]},
                       "topic": {"type": "string", "enum": ["product", "shipping", "support", "price"]}})),
    SchemaRow("schema-nested", "nested", "Extract the shipping details: 'Please send order #W4860251 to Mei "
              "Kovacs, 317 Elm Street, Denver, CO 80202.'",
              _object({"order_id": {"type": "string", "pattern": "^#W[0-9]{7}$"},
                       "recipient": _object({"name": _text(60), "address": _object({
                           "street": _text(80), "city": _text(40), "state": {"type": "string", "pattern": "^[A-Z]{2}$"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})})),
    SchemaRow("schema-array", "array", "List the lines of this order as SKU and quantity: 2 x SKU-TV-SAM65, "
              "1 x SKU-PAPER-A4, 5 x SKU-DETERGENT.",
              _object({"lines": {"type": "array", "minItems": 1, "maxItems": 10,
                                 "items": _object({"sku": _text(32), "quantity": _count(1, 100)})}})),
    SchemaRow("schema-integers", "integer-range", "Fill in the booking form: two adults and one child stay three "
              "nights, and they rate the hotel 4 out of 5.",
              _object({"adults": _count(1, 8), "children": _count(0, 8), "nights": _count(1, 30),
                       "rating": _count(1, 5)})),
    SchemaRow("schema-mixed", "mixed", "Turn this into a flight search: 'Two of us want to fly nonstop from JFK "
              "to SEA in economy, at most 400 dollars each.'",
              _object({"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                       "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                       "cabin": {"type": "string", "enum": ["basic_economy", "economy", "business"]},
                       "nonstop": {"type": "boolean"}, "passengers": _count(1, 9),
                       "max_price_usd": _count(0, 10000)})),
    SchemaRow("object-order", "json_object", "Reply in JSON with the order id and its status: 'Order #W2378156 "
              "was delivered yesterday.'", None),
    SchemaRow("object-city", "json_object", "Give the city and the country of the Eiffel Tower as a JSON object.",
              None),
)


def load_tool_rows(workloads: Path = WORKLOADS) -> tuple[ToolRow, ...]:
    """Every tool row: merchant, retail, then airline (see the module doc)."""
    return merchant_rows(workloads) + retail_rows(workloads) + airline_rows(workloads)


def merchant_rows(workloads: Path = WORKLOADS) -> tuple[ToolRow, ...]:
    catalog = _tools(workloads / "merchant_100_tools.json")
    recorded = [json.loads(line) for line in _read(workloads / "contextcache" / "queries_openai.jsonl").splitlines()
                if line.strip()]
    questions = [(_last_user(r["messages"]), "contextcache merchant_analytics recording (tool: our label)")
                 for r in recorded if r.get("profile") == "merchant_analytics"]
    unlabelled = [q for q, _ in questions if q not in MERCHANT_RECORDED_LABELS]
    if unlabelled:
        raise RowsError(f"merchant questions without a label in bfcl.py: {unlabelled}")
    pairs = [(q, MERCHANT_RECORDED_LABELS[q], src) for q, src in questions]
    pairs += [(q, tool, "written from the tool's description") for q, tool in MERCHANT_WRITTEN]
    names = [t["function"]["name"] for t in catalog]
    rows = []
    for number, (question, tool, source) in enumerate(pairs):
        offset = _index(names, tool, "merchant") // MERCHANT_SLICE * MERCHANT_SLICE
        rows.append(ToolRow(f"merchant-{number:02d}", "merchant", MERCHANT_SYSTEM,
                            tuple(catalog[offset:offset + MERCHANT_SLICE]), offset,
                            ({"role": "user", "content": question},), tool, source))
    return tuple(rows)


def retail_rows(workloads: Path = WORKLOADS) -> tuple[ToolRow, ...]:
    catalog = tuple(_tools(workloads / "retail_16_tools.json"))
    names = [t["function"]["name"] for t in catalog]
    return tuple(ToolRow(f"retail-{number:02d}", "retail", RETAIL_SYSTEM, catalog, 0,
                         ({"role": "user", "content": question},), names[_index(names, tool, "retail")],
                         "written from the tool's description (toolkv parity's set)")
                 for number, (question, tool) in enumerate(RETAIL_QUESTIONS))


def airline_rows(workloads: Path = WORKLOADS) -> tuple[ToolRow, ...]:
    """One row per conversation (trial 0), from its longest recorded turn: the messages up to the
    agent's first call, and that call's tool."""
    path = workloads / "tau_bench" / "airline_trajectory_turns.head150.jsonl"
    catalog = tuple(_tools(workloads / "tau_bench" / "tools_airline.json"))
    longest: dict[int, dict[str, Any]] = {}
    for line in _read(path).splitlines():
        turn = json.loads(line) if line.strip() else None
        if turn and turn["trial"] == 0 and len(turn["messages"]) > len(longest.get(turn["task_id"], {}).get(
                "messages", ())):
            longest[turn["task_id"]] = turn
    rows = []
    for task_id, turn in sorted(longest.items()):
        messages = turn["messages"]
        at = next((i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("tool_calls")), None)
        if at is None or messages[0]["role"] != "system":
            continue
        tool = messages[at]["tool_calls"][0]["function"]["name"]
        rows.append(ToolRow(f"airline-{task_id:02d}", "airline", messages[0]["content"], catalog, 0,
                            tuple(_plain(m) for m in messages[1:at]), tool,
                            f"tau-bench airline task {task_id}, trial 0: the turns before the agent's first call"))
    return tuple(rows)


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    return {"role": message["role"], "content": message.get("content") or ""}


def _last_user(messages: list[dict[str, Any]]) -> str:
    return str(next(m["content"] for m in reversed(messages) if m["role"] == "user"))


def _index(names: list[str], tool: str, catalog: str) -> int:
    if tool not in names:
        raise RowsError(f"{catalog} rows expect {tool!r}, which is not in the catalog")
    return names.index(tool)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise RowsError(f"workload file not found: {path}") from None


def _tools(path: Path) -> list[dict[str, Any]]:
    data = json.loads(_read(path))
    tools = data.get("tools") if isinstance(data, dict) else data
    if not isinstance(tools, list):
        raise RowsError(f"{path} holds no list of tools")
    return tools


QUICK_TOOL_ROWS = ("merchant-00", "merchant-13", "retail-02", "retail-09", "airline-10")
QUICK_SCHEMA_ROWS = ("schema-enum", "schema-nested", "schema-array", "schema-integers", "object-city")


def quick(rows: tuple[ToolRow, ...], schema_rows: tuple[SchemaRow, ...]) -> tuple[tuple[ToolRow, ...],
                                                                                 tuple[SchemaRow, ...]]:
    """The handful `--quick` runs: a row of each catalog and one schema row of each shape."""
    return (tuple(r for r in rows if r.id in QUICK_TOOL_ROWS),
            tuple(r for r in schema_rows if r.id in QUICK_SCHEMA_ROWS))
