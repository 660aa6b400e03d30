"""``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``: a stored response deleted,
and the items it was given, as OpenAI's Responses API has them.

A response's input items are the conversation it answered, instructions aside: the input and output
items of the stored responses it chains on (``previous_response_id``, oldest first), then its own
input. A response that others chain on can be deleted: just that one goes (as OpenAI does), so a new
request chaining through it is a 404, and the items listed for a later response start after it. The
pooled sessions are found by content, so deleting a response leaves them as they are.
"""

from __future__ import annotations

import hashlib
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..images import Image, image_part
from ..messages import ChatMessage, Role
from .errors import BadRequestError
from .response_store import ResponseStore
from .state import ServerState
from .wire import arguments_text

MAX_LIMIT = 100


async def delete(state: ServerState, request: Request) -> Response:
    """Delete a stored response; 404 when this server holds none with that id."""
    rid = request.path_params["rid"]
    state.responses.delete(rid)
    return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})


async def input_items(state: ServerState, request: Request) -> Response:
    """A page of a stored response's input items: ``limit`` (1 to 100, default 20), ``order`` (``desc``,
    the default, or ``asc``), ``after`` / ``before`` (an item id of the list)."""
    query = request.query_params
    limit = _limit(query.get("limit"))
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequestError(f"order must be 'asc' or 'desc', not {order!r}.", param="order")
    items = conversation_items(state.responses, request.path_params["rid"])
    if order == "desc":
        items.reverse()
    for param in ("after", "before"):
        anchor = query.get(param)
        if anchor is not None:
            ids = [item["id"] for item in items]
            if anchor not in ids:
                raise BadRequestError(f"{param}: {anchor!r} is not an input item of this response.", param=param)
            at = ids.index(anchor)
            items = items[at + 1:] if param == "after" else items[:at]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


def conversation_items(store: ResponseStore, rid: str) -> list[dict[str, Any]]:
    """Response ``rid``'s input items, oldest first (see the module docstring)."""
    chain = store.held_chain(rid)
    items: list[dict[str, Any]] = []
    for held in chain:
        items += message_items(held, store.added(held))
        if held != rid:
            items += store.get(held)["output"]
    return items


def message_items(rid: str, messages: tuple[ChatMessage, ...]) -> list[dict[str, Any]]:
    """Messages a response was given as input items, with ids that stay the same at every listing."""
    out: list[dict[str, Any]] = []

    def add(prefix: str, item: dict[str, Any]) -> None:
        digest = hashlib.sha256(f"{rid}/{len(out)}".encode()).hexdigest()[:32]
        out.append({"id": f"{prefix}_{digest}", **item})

    for m in messages:
        if m.role is Role.TOOL:
            add("fco", {"type": "function_call_output", "call_id": m.tool_call_id, "output": m.content,
                        "status": "completed"})
        elif m.role is not Role.ASSISTANT:
            add("msg", {"type": "message", "role": m.role.value, "status": "completed",
                        "content": [*map(_input_image, m.images), {"type": "input_text", "text": m.content}]})
        else:
            if m.reasoning:
                add("rs", {"type": "reasoning", "summary": [], "status": "completed",
                           "content": [{"type": "reasoning_text", "text": m.reasoning}]})
            if m.content or not m.tool_calls:
                add("msg", {"type": "message", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": m.content, "annotations": []}]})
            for call in m.tool_calls:
                add("fc", {"type": "function_call", "call_id": call.id, "name": call.name,
                           "arguments": arguments_text(call), "status": "completed"})
    return out


def _input_image(image: Image) -> dict[str, Any]:
    """An image the response was given, as OpenAI lists it: a PNG data URL of the pixels the store kept."""
    return {"type": "input_image", "detail": "auto", "file_id": None,
            "image_url": image_part(image, pixels=True).get("image")}


def _limit(raw: str | None) -> int:
    if raw is None:
        return 20
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise BadRequestError(f"limit must be a whole number from 1 to {MAX_LIMIT}, not {raw!r}.", param="limit")
    return limit


__all__ = ["conversation_items", "delete", "input_items", "message_items"]
