"""Kept responses read back: `GET /v1/responses/{id}` (the response object as it was returned),
`DELETE /v1/responses/{id}`, and `GET /v1/responses/{id}/input_items` (the response's own
`input`, as OpenAI lists items: each with an id, newest first unless `order=asc`, `limit` per
page, `after` an item id). A response still being generated is read `in_progress`, and a DELETE of
it sticks: it is not kept when it ends. Another API key's response, a deleted one and a `store: false` one
are not found (404): a tenant never learns whether someone else's id exists."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.api.responses.store import StoredResponse
from gateway.api.state import gateway_state
from gateway.edge.handlers import validation_error
from gateway.errors import BadRequest, NotFound
from gateway.protocol.responses import FunctionCallItem, InputItem, MessageItem, TextPart
from gateway.protocol.responses_output import function_call_item, new_item_id, text_part

router = APIRouter()


class InputItemsQuery(BaseModel):
    """The list's query string (text, so numbers are parsed); `include` asks nothing of these
    items (they hold no images, hosted tool calls or reasoning), so it and others are ignored."""

    model_config = ConfigDict(extra="ignore")
    limit: int = Field(20, ge=1, le=100)
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> JSONResponse:
    gateway_state(request.app).keyring.tenant(request)  # a missing key is a 401 before anything else
    if request.query_params.get("stream", "false").lower() not in ("false", "0"):
        raise BadRequest("'stream' is not supported here: a kept response is returned whole", param="stream",
                         code="unsupported_parameter")
    return JSONResponse(_stored(request, response_id).body)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> JSONResponse:
    state = gateway_state(request.app)
    tenant = state.keyring.tenant(request)
    if not state.responses.delete(tenant.salt, response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: Request, response_id: str) -> JSONResponse:
    try:
        query = InputItemsQuery.model_validate(dict(request.query_params))
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    return JSONResponse(page(_stored(request, response_id).input_items, query))


def _stored(request: Request, response_id: str) -> StoredResponse:
    state = gateway_state(request.app)
    tenant = state.keyring.tenant(request)  # 401 before anything is looked up
    stored = state.responses.find(tenant.salt, response_id)  # kept, or still running (`in_progress`)
    if stored is None:
        raise _not_found(response_id)
    return stored


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id[:100]}' not found.", param="response_id")


def page(items: tuple[dict[str, Any], ...], query: InputItemsQuery) -> dict[str, Any]:
    """One page of `items` (oldest first) as OpenAI's list object."""
    ordered = list(items) if query.order == "asc" else list(reversed(items))
    start = 0
    if query.after is not None:
        ids = [item["id"] for item in ordered]
        if query.after not in ids:
            raise BadRequest(f"'after' names the item '{query.after[:100]}', which is not an input item of this "
                             "response", param="after")
        start = ids.index(query.after) + 1
    data = ordered[start:start + query.limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + len(data) < len(ordered)}


# ---- input items as listed ---------------------------------------------------------------------


def listed_items(request_input: list[InputItem] | str | None) -> tuple[dict[str, Any], ...]:
    """A request's `input` as OpenAI lists it: each item with its own id if it was sent one (a
    past output item sent back), a new one otherwise."""
    if request_input is None:
        return ()
    if isinstance(request_input, str):
        return (_input_message(new_item_id("msg"), "user", request_input),)
    return tuple(_listed(item) for item in request_input)


def _listed(item: InputItem) -> dict[str, Any]:
    if isinstance(item, MessageItem):
        item_id = item.id or new_item_id("msg")
        if item.role != "assistant":
            return _input_message(item_id, item.role, item.content)
        return {"id": item_id, "type": "message", "status": "completed", "role": "assistant",
                "content": [text_part(text) for text in _texts(item.content)]}
    if isinstance(item, FunctionCallItem):
        return function_call_item(item.id or new_item_id("fc"), item.call_id, item.name, item.arguments, "completed")
    output = item.output if isinstance(item.output, str) else _input_parts(item.output)
    return {"id": item.id or new_item_id("fco"), "type": "function_call_output", "status": "completed",
            "call_id": item.call_id, "output": output}


def _input_message(item_id: str, role: str, content: str | list[TextPart]) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": "completed", "role": role, "content": _input_parts(content)}


def _input_parts(content: str | list[TextPart]) -> list[dict[str, Any]]:
    return [{"type": "input_text", "text": text} for text in _texts(content)]


def _texts(content: str | list[TextPart]) -> list[str]:
    return [content] if isinstance(content, str) else [part.text for part in content]
