"""What the client tests ask: a retail tool set, and replies scripted in the Hermes syntax the
ChatML family parses (the server runs a scripted tiny SmolLM2-tokenizer model)."""

from __future__ import annotations

import json
from typing import Any

from tests.support.family_models import script

MODEL = "tiny-scripted"
SYSTEM = "You are a retail agent. Use the tools to answer."
ORDER_ID = "#W2378156"
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_order_details", "description": "Get the status and details of an order.",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                       "required": ["order_id"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_user_details", "description": "Get the details of a user, including their orders.",
        "parameters": {"type": "object", "properties": {"user_id": {"type": "string"}},
                       "required": ["user_id"], "additionalProperties": False}}},
]
ORDER_ARGS = {"order_id": ORDER_ID}
USER_ARGS = {"user_id": "yusuf_rossi_9620"}
FINAL_ANSWER = "Your order #W2378156 was delivered on May 2."


def hermes_calls(*calls: tuple[str, dict[str, Any]]) -> str:
    return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)


def ask(reply: str) -> list[dict[str, Any]]:
    """Messages whose answer, from the scripted model, is `reply`."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": script(reply)}]


def tool_result(data: dict[str, Any], next_reply: str) -> str:
    """A tool result that makes the scripted model answer `next_reply` in the next step."""
    return json.dumps(data) + " " + script(next_reply)
