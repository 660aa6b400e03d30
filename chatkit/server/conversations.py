"""``GET /v1/conversations`` and ``GET /v1/conversations/{id}``: the conversations in the response
store, for the chat page (and any client) to list and open. Not an OpenAI API: the Responses API has
no listing.

A conversation is the tree of stored responses under one first response: chaining on a response with
``previous_response_id`` continues it, chaining on an earlier one (to regenerate or edit a turn) makes
a branch. The listing gives each conversation once, with its head (its newest response), a title (its
first user message), when it was last updated and the number of turns up to the head, newest first;
``GET /v1/conversations/{id}`` gives the turns of the chain ending at response ``id``: each response
object with the input items it added. A deleted response leaves the rest of its conversation listed and
openable: the responses after it are listed as a conversation of their own, opened from the first of
them (``gap``: true, earlier turns were deleted)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..messages import ChatMessage, Role
from .errors import BadRequestError
from .response_items import _limit
from .state import ServerState
from .wire import arguments_text


async def list_all(state: ServerState, request: Request) -> Response:
    """A page of the stored conversations, newest first: ``limit`` (1 to 100, default 20) after the
    conversation ``after`` (an id of the list), as ``input_items`` pages (``first_id``, ``last_id``, ``has_more``)."""
    limit = _limit(request.query_params.get("limit"))
    listed = state.responses.conversations()
    after = request.query_params.get("after")
    if after is not None:
        ids = [c["id"] for c in listed]
        if after not in ids:
            raise BadRequestError(f"after: {after!r} is not a stored conversation's id (it may have been deleted): "
                                  "list from the start.", param="after")
        listed = listed[ids.index(after) + 1:]
    page = listed[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(listed) > limit})


async def retrieve(state: ServerState, request: Request) -> Response:
    """The turns of the chain ending at response ``id``; 404 when this server holds no such response."""
    rid = request.path_params["rid"]
    held = state.responses.turns(rid)
    turns = [{"input": input_items(added), "response": response} for response, added in held]
    gap = held[0][0].get("previous_response_id") is not None  # earlier responses were deleted
    return JSONResponse({"object": "conversation.turns", "head": rid, "gap": gap, "data": turns})


def input_items(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the Responses API's input items (messages, function calls, function call outputs),
    in the shape a client sends them (the page re-sends them to regenerate), not ``input_items``' listing
    shape (``response_items.message_items``: ids, status, content parts, reasoning items)."""
    items: list[dict[str, Any]] = []
    for m in messages:
        if m.role is Role.TOOL:
            items.append({"type": "function_call_output", "call_id": m.tool_call_id, "output": m.content})
            continue
        if m.content or not m.tool_calls:
            items.append({"type": "message", "role": m.role.value, "content": m.content})
        items += [{"type": "function_call", "call_id": c.id, "name": c.name, "arguments": arguments_text(c)}
                  for c in m.tool_calls]
    return items


__all__ = ["input_items", "list_all", "retrieve"]
