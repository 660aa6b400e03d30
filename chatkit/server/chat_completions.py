"""``POST /v1/chat/completions``: the request read into a ``TurnRequest``, the turn run on the
conversation's pooled session, the reply sent as one ``chat.completion`` or as server-sent
``chat.completion.chunk`` events (reasoning in ``reasoning_content``, tool calls in ``tool_calls``)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ..messages import ChatMessage, ToolCall
from ..params import GenerateParams
from ..session.aio import AsyncResponseStream
from ..session.results import TurnStats
from ..text.reply import PieceKind
from .body import read_metadata, read_object
from .choices import more_choices, read_n
from .errors import BadRequestError, error_body
from .logprobs import Logprobs, read_logprobs
from .state import ServerState, reply_of
from .turns import Codec, run_turn
from .wire import (
    TurnRequest,
    arguments_text,
    compaction_usage,
    format_schema,
    link_tool_results,
    read_bool,
    read_message,
    read_model,
    read_params,
    read_tools,
    split_conversation,
)

FINISH = {"stop": "stop", "length": "length", "cancelled": "stop", None: "stop"}


class ChatCodec(Codec):
    """Chat completions on the wire: a ``chat.completion``, or ``chat.completion.chunk`` events (each
    choice in turn, its chunks carrying its ``index``: the role, the pieces, the finish reason), the
    usage if asked, ``[DONE]``."""

    prefix = "chatcmpl"

    def __init__(self, state: ServerState, req: TurnRequest) -> None:
        super().__init__(state, req)
        self.model = ""
        self.choices: list[dict[str, Any]] = []  # (not streamed) each choice's object
        self.completion = 0  # the tokens of all choices
        self.calls = 0  # (streamed) the tool calls the current choice sent
        self._index = 0  # (streamed) the current choice
        self._reply: Callable[[], ChatMessage] = lambda: ChatMessage.assistant("")

    @staticmethod
    def parse(body: Any, defaults: GenerateParams) -> TurnRequest:
        return parse_chat(body, defaults)

    async def streams(self) -> AsyncIterator[tuple[int, AsyncResponseStream]]:
        """The lease's turn, then ``n - 1`` forks (``choices``), each counted in ``/metrics`` once the
        runner closed it (the lease's turn is counted where it settles)."""
        lease = self.lease
        self.model, self._reply = lease.model, lambda: reply_of(lease)
        yield 0, lease.stream
        async for choice in more_choices(lease, self.req.n, self.state.sessions.run):
            self._reply = choice.reply
            yield choice.index, choice.stream
            self.state.metrics.observe_turn(choice.stream.stats)

    def opened(self, index: int) -> Iterable[str]:
        self.calls, self._index = 0, index
        yield _sse(chat_chunk(self.id, self.model, {"role": "assistant", "content": ""}, index=index))

    def piece(self, kind: PieceKind, value: Any, read: Logprobs | None) -> Iterable[str]:
        yield _sse(chat_chunk(self.id, self.model, _delta(kind, value, self.calls), logprobs=_taken(read),
                              index=self._index))
        self.calls += kind == PieceKind.TOOL_CALL

    def done(self, index: int, stream: AsyncResponseStream, finish: str | None, read: Logprobs | None) -> None:
        self.completion += stream.stats.generation_tokens if stream.stats is not None else 0
        if not self.req.stream:
            message = self._reply()
            self.choices.append({"index": index, "message": chat_message(message),
                                 "finish_reason": finish_reason(finish, bool(message.tool_calls)),
                                 "logprobs": None if read is None else {"content": read.entries, "refusal": None}})

    def closed(self, index: int, finish: str | None, read: Logprobs | None) -> Iterable[str]:
        yield _sse(chat_chunk(self.id, self.model, {}, finish_reason(finish, self.calls > 0), logprobs=_taken(read),
                              index=index))

    def end(self) -> Iterable[str]:
        if self.req.include_usage:
            usage = chat_usage(self.lease.stream.stats, self.lease.compaction(), self.completion)
            yield _sse(chat_chunk(self.id, self.model, {}, usage=usage))
        yield "data: [DONE]\n\n"

    def error(self, exc: Exception) -> str:
        return _sse(error_body(exc)[1])

    async def body(self) -> Mapping[str, Any]:
        usage = chat_usage(self.lease.stream.stats, self.lease.compaction(), self.completion)
        return chat_completion(self.id, self.model, self.choices, usage)


async def create(state: ServerState, request: Request) -> Response:
    """Answer the conversation the request sends (its last message, or the results of the last reply's calls)."""
    return await run_turn(state, ChatCodec, request)


def _taken(read: Logprobs | None) -> dict[str, Any] | None:
    """The entries since the last chunk sent, when asked."""
    return None if read is None else {"content": read.take(), "refusal": None}


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
    "FINISH", "ChatCodec", "chat_chunk", "chat_completion", "chat_message", "chat_usage", "create", "finish_reason", "parse_chat",
    "tool_call_object",
]
