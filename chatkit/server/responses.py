"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: OpenAI's Responses API. The input (a string,
or messages, ``function_call``, ``function_call_output`` and ``reasoning`` items) goes on after the stored
conversation that ``previous_response_id`` names; the reply is sent as a ``response`` object with its
output items, or as the API's server-sent events; the response is stored (unless ``store: false``) with
what it added to the conversation, so that the next one can chain on it."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import ChatKitError
from ..messages import ChatMessage, Role, ToolCall
from ..params import GenerateParams
from ..session.aio import AsyncResponseStream
from ..session.results import TurnStats
from ..text.reply import PieceKind
from . import trace
from .body import read_metadata, read_object
from .errors import BadRequestError, error_body
from .lease import Lease
from .logprobs import Logprobs, read_included
from .state import ServerState, reply_of
from .turns import Codec, run_turn
from .wire import (
    TurnRequest,
    arguments_text,
    compaction_usage,
    format_schema,
    link_tool_results,
    new_id,
    read_bool,
    read_message,
    read_model,
    read_params,
    read_text,
    read_tool_call,
    read_tools,
    split_conversation,
)


class ResponsesCodec(Codec):
    """The Responses API on the wire: one ``response`` object, or its events: created, in progress, its
    output items as they stream, then completed (or incomplete). However the stream ends (an error, the
    client gone) the response is kept (``keep``), as far as the turn got."""

    prefix = "resp"

    def __init__(self, state: ServerState, req: TurnRequest) -> None:
        super().__init__(state, req)
        self.created = int(time.time())
        self.items = OutputItems(Logprobs(state.lm.tokenizer, req.logprobs) if req.logprobs is not None else None)
        self.out = _EventWriter(self.items)
        self.finish: str | None = None
        self._added: Sequence[ChatMessage] = ()

    @staticmethod
    def parse(body: Any, defaults: GenerateParams) -> TurnRequest:
        return parse_responses(body, defaults)

    async def open(self) -> Lease:
        """The input goes on after the conversation ``previous_response_id`` names (if any), on its model."""
        state, req = self.state, self.req
        before = state.responses.transcript(req.previous_response_id) if req.previous_response_id else ()
        model = (state.models.chained(req.model, state.responses.get(req.previous_response_id).get("model", ""))
                 if req.previous_response_id else state.models.select(req.model))  # a chain keeps its model
        linked = link_tool_results([*before, *req.added], "input", offset=len(before))
        self._added = tuple(linked[len(before):])  # tool results named after their calls
        instructions, history, new = split_conversation(req.instructions, linked)
        return await state.open_turn(req, instructions, history, new, keep=req.store, model=model)

    def reader(self) -> Logprobs | None:
        return self.items.read

    def start(self) -> Iterable[str]:
        yield self.out.event("response.created", response=self.object("in_progress", []))
        yield self.out.event("response.in_progress", response=self.object("in_progress", []))

    def piece(self, kind: PieceKind, value: Any, read: Logprobs | None) -> Iterable[str]:
        return self.out.pieces(kind, value)

    def done(self, index: int, stream: AsyncResponseStream, finish: str | None, read: Logprobs | None) -> None:
        self.finish = finish

    async def after(self, ended: str) -> Iterable[str]:
        try:
            kept = await self.keep(self.finish, ended)
        except ChatKitError as exc:  # not stored: the client is told instead of "completed"
            return [self.error(exc)] if ended == "done" else []
        if ended != "done":
            return []
        kind = "response.incomplete" if kept["status"] == "incomplete" else "response.completed"
        return [*self.out.end(), self.out.event(kind, response=kept)]

    def error(self, exc: Exception) -> str:
        return self.out.event("error", **error_body(exc)[1]["error"])

    async def body(self) -> Mapping[str, Any]:
        return await self.keep(self.finish)

    def object(self, status: str, output: list[dict[str, Any]], finish: str | None = None) -> dict[str, Any]:
        """The response object with ``status`` and ``output``, usage as far as the turn got."""
        stats, req = self.lease.stream.stats, self.req
        return response_object(
            self.id, self.lease.model, created_at=self.created, status=status, output=output,
            previous_response_id=req.previous_response_id, store=req.store,
            usage=responses_usage(stats, self.lease.compaction()) if stats is not None else None, echo=req.echo,
            incomplete=finish == "length",
        )

    async def keep(self, finish: str | None, ended: str = "done") -> dict[str, Any]:
        """The response as stored; ``ended``: "done", or "cancelled" (the client went away) or
        "failed" (an error mid-stream), each stored as far as the turn got. ``ChatKitError`` when it
        cannot be stored (e.g. the disk is full). The file is written off the event loop, before the
        client hears the response completed; a client gone meanwhile does not interrupt it."""
        reply = reply_of(self.lease)
        status = ended if ended != "done" else "incomplete" if finish == "length" else "completed"
        obj = self.object(status, self.items.of(reply, status != "completed"), finish)
        if self.req.store and self.lease.reply() is not None:  # committed
            with anyio.CancelScope(shield=True):
                await self.state.responses.add_async(obj, self._added, reply)
            trace.stamp("stored")
        return obj


async def create(state: ServerState, request: Request) -> Response:
    """Answer the input after the conversation ``previous_response_id`` names (if any); store the response."""
    return await run_turn(state, ResponsesCodec, request)


async def retrieve(state: ServerState, request: Request) -> Response:
    """A stored response by its id; 404 when this server holds none."""
    return JSONResponse(state.responses.get(request.path_params["rid"]))


class _EventWriter:
    """The events of one streamed response's output items: each item added, its deltas, done."""

    def __init__(self, items: OutputItems) -> None:
        self.items = items
        self._seq = itertools.count()
        self._kinds: list[PieceKind] = []  # the kind of each output item streamed so far, by output_index
        self._open: PieceKind | None = None  # the kind of the reasoning or message item being streamed
        self._text = ""  # its text so far

    def event(self, kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(self._seq), **data})}\n\n"

    def pieces(self, kind: PieceKind, value: Any) -> Iterator[str]:
        """The events of one piece of the reply (``Deltas``)."""
        if kind != self._open:
            yield from self._close_item()
            index = len(self._kinds)
            self._kinds.append(kind)
            if kind == PieceKind.TOOL_CALL:
                yield from self._call(value, index)
                return
            yield from self._open_item(kind, index)
        self._text += value
        where = {"output_index": len(self._kinds) - 1, "content_index": 0, "delta": value}
        if kind == PieceKind.REASONING:
            yield self.event("response.reasoning_text.delta", item_id=self.items.id("reasoning"), **where)
        elif value:
            yield self.event("response.output_text.delta", item_id=self.items.id("message"), **where,
                             logprobs=self.items.read.take() if self.items.read is not None else [])

    def end(self) -> Iterator[str]:
        """The events that close the output: an empty answer still has its message item."""
        if not any(k != PieceKind.REASONING for k in self._kinds):
            yield from self.pieces(PieceKind.TEXT, "")
        yield from self._close_item()

    def _open_item(self, kind: PieceKind, index: int) -> Iterator[str]:
        """The events that start a reasoning or message item."""
        self._open, self._text = kind, ""
        if kind in self._kinds[:-1]:
            self.items.renew("reasoning" if kind == PieceKind.REASONING else "message")
        if kind == PieceKind.REASONING:
            item = {**self.items.reasoning("", "in_progress"), "content": []}
            yield self.event("response.output_item.added", output_index=index, item=item)
        else:
            yield self.event("response.output_item.added", output_index=index, item=self.items.message("", "in_progress"))
            yield self.event("response.content_part.added", item_id=self.items.id("message"), output_index=index,
                             content_index=0, part={"type": "output_text", "text": "", "annotations": []})

    def _close_item(self) -> Iterator[str]:
        """The done events of the reasoning or message item being streamed, if any."""
        kind, text, index = self._open, self._text, len(self._kinds) - 1
        self._open = None
        if kind == PieceKind.REASONING:
            where = {"item_id": self.items.id("reasoning"), "output_index": index, "content_index": 0}
            yield self.event("response.reasoning_text.done", **where, text=text)
            yield self.event("response.output_item.done", output_index=index, item=self.items.reasoning(text))
        elif kind == PieceKind.TEXT:
            where = {"item_id": self.items.id("message"), "output_index": index, "content_index": 0}
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": self.items.logprobs()}
            yield self.event("response.output_text.done", **where, text=text, logprobs=part["logprobs"])
            yield self.event("response.content_part.done", **where, part=part)
            yield self.event("response.output_item.done", output_index=index, item=self.items.message(text))

    def _call(self, call: ToolCall, index: int) -> Iterator[str]:
        """The events of a function call item, whole: a call streams once it is complete."""
        where = {"item_id": self.items.id(call.id), "output_index": index}
        done = self.items.call(call)
        yield self.event("response.output_item.added", output_index=index, item=self.items.call(call, "in_progress"))
        yield self.event("response.function_call_arguments.delta", **where, delta=done["arguments"])
        yield self.event("response.function_call_arguments.done", **where, arguments=done["arguments"], name=call.name)
        yield self.event("response.output_item.done", output_index=index, item=done)


# -- reading the request ------------------------------------------------------------------------
def parse_responses(body: Any, defaults: GenerateParams) -> TurnRequest:
    """A ``POST /v1/responses`` body. ``added`` is its input as messages (function calls and their
    outputs as assistant tool calls and tool messages); the app puts it after the stored conversation."""
    body = read_object(body)
    tool_fields = read_tools(body, flat=True)
    tools, strict = tool_fields["tools"], tool_fields["strict_tools"]
    if body.get("reasoning"):
        raise BadRequestError("reasoning options are not supported by chatkit serve yet: leave them out.",
                              param="reasoning")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequestError("instructions must be a string.", param="instructions")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise BadRequestError("previous_response_id must be a response id string.", param="previous_response_id")
    raw = body.get("input")
    if isinstance(raw, str):
        items = [ChatMessage.user(raw)]
    elif isinstance(raw, list) and raw:
        items = _input_items(raw)
    else:
        raise BadRequestError("input: a string or a non-empty list of messages is required.", param="input")
    if items[-1].role is Role.ASSISTANT:
        raise BadRequestError("input: the last item must be a user message or a function_call_output for the "
                              "model to answer.", param="input")
    if not items[-1].content.strip():
        raise BadRequestError("input: the last message is empty: send some text.", param="input")
    text = body.get("text") or {}
    schema = format_schema(text.get("format") if isinstance(text, Mapping) else None, "text.format")
    echo = {k: body.get(k) for k in ("instructions", "max_output_tokens", "temperature", "top_p")}
    echo["metadata"] = read_metadata(body)
    echo["tools"] = [{"type": "function", **t["function"], "strict": strict} for t in tools or ()]
    echo["tool_choice"] = body.get("tool_choice") or "auto"
    echo["parallel_tool_calls"] = tool_fields["parallel_tool_calls"]
    return TurnRequest(
        instructions, (), tuple(items),
        params=read_params(body, defaults, body.get("max_output_tokens"), "max_output_tokens"),
        stream=read_bool(body, "stream", False),
        schema=schema,
        previous_response_id=previous,
        store=read_bool(body, "store", True),
        logprobs=read_included(body),
        model=read_model(body),
        **tool_fields,
        echo=echo,
    )

def _input_items(raw: list[Any]) -> list[ChatMessage]:
    """The Responses API's input items as messages: a reasoning item, an assistant message and the
    function_call items after it are one assistant message; a function_call_output is a tool message."""
    out: list[ChatMessage] = []
    joinable = False  # the last message is an assistant turn the next output items belong to
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise BadRequestError(f"{where} must be an object (a message or another input item).", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            message = read_message(item, where)
            last = out[-1] if out and joinable else None
            if message.role is Role.ASSISTANT and last is not None and not last.content and not last.tool_calls:
                out[-1] = replace(last, content=message.content)  # after its reasoning item
            else:
                out.append(message)
            joinable = message.role is Role.ASSISTANT
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            texts = [p.get("text") for p in parts if isinstance(p, Mapping)] if isinstance(parts, list) else [None]
            if not all(isinstance(t, str) for t in texts):
                raise BadRequestError(f"{where}: a reasoning item's content is a list of {{type, text}} parts.",
                                      param=where)
            out.append(ChatMessage.assistant("", reasoning="".join(t for t in texts if t)))
            joinable = True
        elif kind == "function_call":
            function = {"name": item.get("name"), "arguments": item.get("arguments", "{}")}
            call = read_tool_call({"id": item.get("call_id"), "function": function}, where)
            if out and joinable:
                out[-1] = replace(out[-1], tool_calls=(*out[-1].tool_calls, call))
            else:
                out.append(ChatMessage.assistant("", tool_calls=[call]))
            joinable = True
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise BadRequestError(f"{where}: a function_call_output needs the call_id it answers.", param=where)
            output = item.get("output")
            text = output if isinstance(output, str) else read_text(output, f"{where}.output")
            out.append(ChatMessage.tool(text, tool_call_id=call_id))
            joinable = False
        else:
            raise BadRequestError(f"{where}: input items of type {kind!r} are not supported: send messages, "
                                  "function_call and function_call_output items.", param=where)
    return out


# -- building the response ----------------------------------------------------------------------
def responses_usage(stats: TurnStats | None, compaction: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The ``usage`` object (with ``context`` when the turn compacted the conversation's context)."""
    prompt = stats.prompt_tokens if stats else 0
    output = stats.generation_tokens if stats else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": stats.reused_tokens if stats else 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
        **compaction_usage(compaction),
    }


class OutputItems:
    """The output items of one response (reasoning, message, function calls), with ids that stay the
    same from the first stream event to the stored response."""

    def __init__(self, read: Logprobs | None = None) -> None:
        self._ids: dict[str, str] = {}
        self.read = read  # the reply's log-probabilities, when the request includes them

    def logprobs(self) -> list[dict[str, Any]]:
        """An output_text part's ``logprobs``: the reply's text tokens so far (none unless asked)."""
        return list(self.read.entries) if self.read is not None else []

    def id(self, key: str) -> str:
        """The item id for ``"reasoning"``, ``"message"`` or a call id."""
        if key not in self._ids:
            prefix = {"reasoning": "rs", "message": "msg"}.get(key, "fc")
            self._ids[key] = new_id(prefix)
        return self._ids[key]

    def renew(self, key: str) -> None:
        """A second reasoning or message item (after a tool call) gets an id of its own."""
        self._ids.pop(key, None)

    def reasoning(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "reasoning", "id": self.id("reasoning"), "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}

    def message(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = ([{"type": "output_text", "text": text, "annotations": [], "logprobs": self.logprobs()}]
                   if status != "in_progress" else [])
        return {"type": "message", "id": self.id("message"), "status": status, "role": "assistant", "content": content}

    def call(self, call: ToolCall, status: str = "completed") -> dict[str, Any]:
        arguments = arguments_text(call) if status != "in_progress" else ""
        return {"type": "function_call", "id": self.id(call.id), "call_id": call.id, "name": call.name,
                "arguments": arguments, "status": status}

    def of(self, reply: ChatMessage, incomplete: bool = False) -> list[dict[str, Any]]:
        """A reply's items: its reasoning, its answer (also when empty, unless it only calls tools), its calls."""
        status = "incomplete" if incomplete else "completed"
        items = [self.reasoning(reply.reasoning, status)] if reply.reasoning else []
        if reply.content or not reply.tool_calls:
            items.append(self.message(reply.content, status))
        return items + [self.call(c, status) for c in reply.tool_calls]


def response_object(rid: str, model: str, *, created_at: int, status: str, output: list[dict[str, Any]],
                    previous_response_id: str | None, store: bool, usage: dict[str, Any] | None,
                    echo: Mapping[str, Any], incomplete: bool = False) -> dict[str, Any]:
    """A ``response`` object (``output`` empty while it is in progress)."""
    return {
        "id": rid, "object": "response", "created_at": created_at, "status": status, "model": model,
        "output": output, "previous_response_id": previous_response_id, "store": store, "usage": usage,
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": echo.get("instructions"), "max_output_tokens": echo.get("max_output_tokens"),
        "temperature": echo.get("temperature"), "top_p": echo.get("top_p"), "metadata": echo.get("metadata") or {},
        "parallel_tool_calls": echo.get("parallel_tool_calls", True), "tool_choice": echo.get("tool_choice", "auto"), "tools": echo.get("tools", []),
        "text": {"format": {"type": "text"}},
    }

__all__ = ["OutputItems", "ResponsesCodec", "create", "parse_responses", "response_object", "responses_usage", "retrieve"]
