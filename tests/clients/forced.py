"""What the real default model is asked in the forced and structured client tests, and what a user
of any client must get back: a call to a listed tool whose arguments validate against that tool's
JSON schema; a streamed call whose first delta names it and whose arguments follow in later deltas,
with no call markup in the text; JSON that parses into the requested model."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from jsonschema import Draft202012Validator
from pydantic import BaseModel, Field

from gateway.bench.data import RETAIL_TOOLS as RETAIL_TOOLS_FILE
from tests.clients.spec_wire import Exchange

RETAIL_TOOLS: list[dict[str, Any]] = json.loads(RETAIL_TOOLS_FILE.read_text())
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a customer support agent of an online retail store. Use the tools to help the user."
ORDER_ID = "#W2378156"
CANCEL_REQUEST = f"Please cancel my order {ORDER_ID}, I no longer need it."
STATUS_REQUEST = f"Where is my order {ORDER_ID}? Please look it up."
CALL_MAX_TOKENS = 96  # a retail call with its arguments is 20-40 tokens; the model decodes ~50 ms/token
MARKUP = ("<tool_call>", "</tool_call>")
# Six of the 16 (a 3,000-token group costs ~20 s of prefill here): an enum, names sharing prefixes
RETAIL_SUBSET = ("cancel_pending_order", "get_order_details", "get_user_details", "find_user_id_by_email",
                 "modify_pending_order_address", "transfer_to_human_agents")


def retail_tools(*names: str) -> list[dict[str, Any]]:
    """The named tau-bench retail tools (all 16 without names), in the catalog's order."""
    return [t for t in RETAIL_TOOLS if not names or t["function"]["name"] in names]


def messages(question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


class CancellationRequest(BaseModel):
    """An order the customer wants cancelled, and why."""

    order_id: str = Field(description="The order id, such as '#W0000000'.")
    reason: Literal["no longer needed", "ordered by mistake"]


STRUCTURED_REQUEST = f"Extract the order id and the cancellation reason from: '{CANCEL_REQUEST}'"


def assert_valid_call(tools: list[dict[str, Any]], name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
    """The call names one of `tools` (chat or Responses format) and its arguments validate against its schema."""
    functions = [t.get("function", t) for t in tools]
    schemas = {f["name"]: f.get("parameters") or {} for f in functions}
    assert name in schemas, f"{name!r} is not one of the tools {sorted(schemas)}"
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert isinstance(args, dict), f"arguments of {name} are not a JSON object: {arguments!r}"
    Draft202012Validator(schemas[name]).validate(args)
    return args


@dataclass
class StreamedCalls:
    """What a chat stream carried, read as OpenAI sends a call: one delta with index, id, type,
    name and `arguments: ""`, then deltas with argument fragments only."""

    names: dict[int, str] = field(default_factory=dict)
    arguments: dict[int, str] = field(default_factory=dict)
    fragments: dict[int, int] = field(default_factory=dict)
    content: str = ""
    finish_reason: str | None = None

    @classmethod
    def read(cls, chunks: list[dict[str, Any]]) -> StreamedCalls:
        streamed = cls()
        for chunk in chunks:
            for choice in chunk["choices"]:
                streamed._take(choice["delta"])
                streamed.finish_reason = choice.get("finish_reason") or streamed.finish_reason
        return streamed

    def calls(self) -> list[tuple[str, str]]:
        return [(self.names[i], self.arguments[i]) for i in sorted(self.names)]

    def _take(self, delta: dict[str, Any]) -> None:
        self.content += delta.get("content") or ""
        for part in delta.get("tool_calls") or ():
            index, function = part["index"], part.get("function") or {}
            if index not in self.names:
                assert part.get("id") and part.get("type") == "function" and function.get("name"), \
                    f"a call's first delta carries its id, type and name: {part}"
                assert function.get("arguments", "") == "", f"a call's first delta has arguments '': {part}"
                self.names[index], self.arguments[index], self.fragments[index] = function["name"], "", 0
                continue
            assert not part.get("id") and not function.get("name"), f"a call's id and name come once: {part}"
            self.arguments[index] += function.get("arguments") or ""
            self.fragments[index] += bool(function.get("arguments"))


def assert_streamed_forced_call(tools: list[dict[str, Any]], chunks: list[dict[str, Any]]) -> StreamedCalls:
    """A forced call, streamed: no text and no markup, arguments in more than one delta, all valid."""
    streamed = StreamedCalls.read(chunks)
    assert not any(m in streamed.content for m in MARKUP), f"call markup in content: {streamed.content!r}"
    assert streamed.content == "", f"a forced call streamed text: {streamed.content!r}"
    assert streamed.names, "no tool call in the stream"
    for index, name in streamed.names.items():
        assert_valid_call(tools, name, streamed.arguments[index])
        assert streamed.fragments[index] >= 2, f"{name}'s arguments came in one delta, not as generated"
    assert streamed.finish_reason == "tool_calls"
    return streamed


def forced_name(tool_choice: Any) -> str | None:
    """The tool a chat or Responses `tool_choice` names, if it names one."""
    if not isinstance(tool_choice, dict):
        return None
    return str(tool_choice.get("function", tool_choice)["name"])


def assert_forced_exchange(exchange: Exchange) -> list[tuple[str, str]]:
    """What went over the wire for a forced request, whichever client sent it: calls to the request's
    own tools (the named one, when it names one) with schema-valid arguments; streamed as OpenAI does."""
    tools, choice = exchange.request["tools"], exchange.request.get("tool_choice")
    assert choice == "required" or forced_name(choice), f"not a forced request: tool_choice {choice!r}"
    calls = _exchange_calls(exchange)
    assert calls, f"no call in the answer to a forced request: {exchange.body or exchange.chunks[-3:]}"
    for name, arguments in calls:
        assert_valid_call(tools, name, arguments)
        assert forced_name(choice) in (None, name), f"{name} called where {forced_name(choice)} was named"
    return calls


def _exchange_calls(exchange: Exchange) -> list[tuple[str, str]]:
    if exchange.path == "/v1/responses":
        response = exchange.chunks[-1]["response"] if exchange.streamed else exchange.body
        return [(item["name"], item["arguments"]) for item in response["output"] if item["type"] == "function_call"]
    if exchange.streamed:
        return assert_streamed_forced_call(exchange.request["tools"], exchange.chunks).calls()
    message = exchange.body["choices"][0]["message"]
    assert not any(m in (message.get("content") or "") for m in MARKUP), message
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()]


# Handmade Python twins of three retail tools, for the clients that build schemas from functions.

def cancel_pending_order(order_id: str, reason: Literal["no longer needed", "ordered by mistake"]) -> str:
    """Cancel a pending order.

    Args:
        order_id: The order id, such as '#W0000000'.
        reason: The reason for cancellation.
    """
    return json.dumps({"order_id": order_id, "status": "cancelled", "reason": reason})


def get_order_details(order_id: str) -> str:
    """Get the status and details of an order.

    Args:
        order_id: The order id, such as '#W0000000'.
    """
    return json.dumps({"order_id": order_id, "status": "delivered"})


def get_user_details(user_id: str) -> str:
    """Get the details of a user, including their orders.

    Args:
        user_id: The user id, such as 'sara_doe_496'.
    """
    return json.dumps({"user_id": user_id, "orders": [ORDER_ID]})


RETAIL_FUNCTIONS = (cancel_pending_order, get_order_details, get_user_details)
