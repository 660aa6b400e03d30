"""``POST /v1/chat/completions``: the request read into a ``TurnRequest``, the turn run on the
conversation's pooled session, the reply sent as one ``chat.completion`` or as server-sent
``chat.completion.chunk`` events (reasoning in ``reasoning_content``, tool calls in ``tool_calls``)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..messages import ChatMessage, ToolCall
from ..params import GenerateParams
from ..session.aio import AsyncResponseStream
from ..session.results import TurnStats
from ..text.reply import PieceKind
from . import trace
from .body import read_body, read_metadata, read_object
from .choices import more_choices, read_n
from .errors import BadRequestError, error_body
from .lease import Lease
from .logprobs import Logprobs, read_logprobs
from .state import ServerState, reply_of
from .wire import (
    Deltas,
    TurnRequest,
    arguments_text,
    compaction_headers,
    compaction_usage,
    format_schema,
    link_tool_results,
    new_id,
    read_bool,
    read_message,
    read_model,
    read_params,
    read_tools,
    split_conversation,
)

FINISH = {"stop": "stop", "length": "length", "cancelled": "stop", None: "stop"}


async def create(state: ServerState, request: Request) -> Response:
    """Answer the conversation the request sends (its last message, or the results of the last reply's calls)."""
    req = parse_chat(await read_body(request), state.config.defaults)
    lease = await state.open_turn(req, req.instructions, req.history, req.added)
    cid = new_id("chatcmpl")
    if req.stream:
        return StreamingResponse(_events(state, lease, req, cid), media_type="text/event-stream")
    choices: list[dict[str, Any]] = []
    completion = 0
    async with state.settled(lease):
        async for index, stream, reply in _choices(state, lease, req):
            read = Logprobs(state.lm.tokenizer, req.logprobs) if req.logprobs is not None else None
            finish = None
            async with stream:  # closed (committed) however the block ends
                async for chunk in stream:
                    finish = chunk.finish_reason
                    if read is not None:
                        read.feed(chunk)
            message = reply()
            choices.append({"index": index, "message": chat_message(message),
                            "finish_reason": finish_reason(finish, bool(message.tool_calls)),
                            "logprobs": None if read is None else {"content": read.entries, "refusal": None}})
            completion += stream.stats.generation_tokens if stream.stats is not None else 0
    compaction = lease.compaction()
    body = chat_completion(cid, lease.model, choices, chat_usage(lease.stream.stats, compaction, completion))
    return JSONResponse(body, headers=compaction_headers(compaction))


async def _choices(state: ServerState, lease: Lease,
                   req: TurnRequest) -> AsyncIterator[tuple[int, AsyncResponseStream, Callable[[], ChatMessage]]]:
    """(index, stream, its reply once read) of each choice: the lease's turn, then ``n - 1`` forks
    (``choices``), each counted in ``/metrics`` once the caller closed it (the lease's turn is counted
    where it settles)."""
    yield 0, lease.stream, lambda: reply_of(lease)
    async for choice in more_choices(lease, req.n):
        yield choice.index, choice.stream, choice.reply
        state.metrics.observe_turn(choice.stream.stats)


async def _events(state: ServerState, lease: Lease, req: TurnRequest, cid: str) -> AsyncIterator[str]:
    """The reply as server-sent chunks: the role, the pieces, the finish reason (each choice in turn,
    chunks carrying its ``index``), the usage if asked, [DONE]."""
    model = lease.model
    async with state.settled(lease):
        try:
            completion = 0
            async for index, stream, _ in _choices(state, lease, req):
                async with stream:  # closed (committed) however the block ends
                    async for text in _choice_events(state, stream, req, cid, model, index):
                        yield text
                completion += stream.stats.generation_tokens if stream.stats is not None else 0
            if req.include_usage:
                usage = chat_usage(lease.stream.stats, lease.compaction(), completion)
                yield _sse(chat_chunk(cid, model, {}, usage=usage))
            yield "data: [DONE]\n\n"
        except Exception as exc:  # after the headers: the error goes into the stream
            yield _sse(error_body(exc)[1])


async def _choice_events(state: ServerState, stream: AsyncResponseStream, req: TurnRequest, cid: str, model: str,
                         index: int) -> AsyncIterator[str]:
    """One choice's chunks: the role, the pieces, the finish reason."""
    yield _sse(chat_chunk(cid, model, {"role": "assistant", "content": ""}, index=index))
    finish, calls, deltas = None, 0, Deltas()
    read = Logprobs(state.lm.tokenizer, req.logprobs) if req.logprobs is not None else None

    def taken() -> dict[str, Any] | None:  # the entries since the last chunk sent, when asked
        return None if read is None else {"content": read.take(), "refusal": None}

    trace.stamp("turn")
    async for chunk in stream:
        trace.stamp("token")
        finish = chunk.finish_reason
        if read is not None:
            read.feed(chunk)
        for kind, value in deltas.feed(chunk):
            if kind == PieceKind.TEXT and value:
                trace.stamp("text")
            yield _sse(chat_chunk(cid, model, _delta(kind, value, calls), logprobs=taken(), index=index))
            calls += kind == PieceKind.TOOL_CALL
    for kind, value in deltas.end():
        yield _sse(chat_chunk(cid, model, _delta(kind, value, calls), logprobs=taken(), index=index))
    yield _sse(chat_chunk(cid, model, {}, finish_reason(finish, calls > 0), logprobs=taken(), index=index))


# -- reading the request ------------------------------------------------------------------------
def parse_chat(body: Any, defaults: GenerateParams) -> TurnRequest:
    """A ``POST /v1/chat/completions`` body."""
    body = read_object(body)
    read_metadata(body)  # checked as OpenAI does; chatkit keeps no chat completions to attach it to
    tool_fields = read_tools(body, flat=False)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages: a non-empty list of {role, content} objects is required.", param="messages")
    parsed = link_tool_results([read_message(m, f"messages[{i}]") for i, m in enumerate(messages)], "messages")
    instructions, history, added = split_conversation(None, parsed)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise BadRequestError("stream_options must be an object.", param="stream_options")
    return TurnRequest(
        instructions, history, added,
        params=read_params(body, defaults, max_tokens, "max_tokens"),
        stream=read_bool(body, "stream", False),
        include_usage=bool(options.get("include_usage", False)),
        schema=_chat_schema(body.get("response_format")),
        logprobs=read_logprobs(body),
        n=read_n(body),
        model=read_model(body),
        **tool_fields,
    )


def _chat_schema(fmt: Any) -> dict[str, Any] | None:
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise BadRequestError("response_format must be an object.", param="response_format")
    if fmt.get("type") == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, Mapping):
            raise BadRequestError("response_format.json_schema must be an object with a schema.",
                                  param="response_format")
        fmt = {"type": "json_schema", **inner}
    return format_schema(fmt, "response_format")



# -- building the reply -------------------------------------------------------------------------
def finish_reason(finish: str | None, called: bool) -> str:
    """OpenAI's finish reason: ``"tool_calls"`` when a reply that ended by itself called tools."""
    reason = FINISH.get(finish, "stop")
    return "tool_calls" if called and reason == "stop" else reason


def tool_call_object(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """A call in a chat message (``index`` set: in a stream delta), arguments as a JSON string."""
    obj: dict[str, Any] = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments_text(call)}}
    return obj if index is None else {"index": index, **obj}


def chat_message(reply: ChatMessage) -> dict[str, Any]:
    """The assistant message of a chat completion: ``content`` (``None`` when it only calls tools),
    ``reasoning_content`` when it reasoned, ``tool_calls`` when it called tools."""
    message: dict[str, Any] = {"role": "assistant",
                               "content": reply.content if reply.content or not reply.tool_calls else None}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = [tool_call_object(c) for c in reply.tool_calls]
    return message


def chat_usage(stats: TurnStats | None, compaction: Mapping[str, int] | None = None,
               completion: int | None = None) -> dict[str, Any]:
    """The ``usage`` object (with ``context`` when the turn compacted the conversation's context);
    ``completion``: the tokens of all choices (default: the turn's)."""
    prompt = stats.prompt_tokens if stats else 0
    if completion is None:
        completion = stats.generation_tokens if stats else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": stats.reused_tokens if stats else 0},
        **compaction_usage(compaction),
    }


def chat_completion(cid: str, model: str, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
    """A ``chat.completion`` object of ``choices`` (``{index, message, finish_reason, logprobs}``)."""
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage}


def chat_chunk(cid: str, model: str, delta: dict[str, Any], finish: str | None = None,
               usage: dict[str, Any] | None = None, logprobs: dict[str, Any] | None = None,
               index: int = 0) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                             "model": model, "choices": []}
    if usage is None:
        chunk["choices"] = [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]
    else:
        chunk["usage"] = usage
    return chunk

def _delta(kind: PieceKind, value: Any, calls: int) -> dict[str, Any]:
    """The stream delta of one piece of the reply (``Deltas``); ``calls``: the tool calls sent before it."""
    if kind == PieceKind.TOOL_CALL:
        return {"tool_calls": [tool_call_object(value, calls)]}
    return {"reasoning_content" if kind == PieceKind.REASONING else "content": value}


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


__all__ = [
    "FINISH", "chat_chunk", "chat_completion", "chat_message", "chat_usage", "create", "finish_reason", "parse_chat",
    "tool_call_object",
]
