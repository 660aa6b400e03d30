"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API over the
same pooled sessions as chat completions (a re-sent conversation continues its session and pays only
for what is new); the reply is one ``message`` or Anthropic's server-sent events
(``anthropic_wire``)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..messages import ToolCall
from ..model.loaded import LoadedModel
from ..params import GenerateParams
from ..session.aio import AsyncResponseStream
from ..text.reply import PieceKind
from .anthropic_wire import (
    SIGNATURE,
    content_blocks,
    error_body,
    event,
    message,
    parse_messages,
    stop_reason,
    tool_use_block,
    usage,
)
from .body import read_body
from .lease import Lease
from .logprobs import Logprobs
from .state import ServerState, reply_of
from .turns import Codec, run_turn
from .wire import TurnRequest


class MessagesCodec(Codec):
    """Anthropic's Messages API on the wire: one ``message``, or its events: message_start, ping, the
    content blocks, message_delta (the stop reason and usage), message_stop."""

    prefix = "msg"

    def __init__(self, state: ServerState, req: TurnRequest) -> None:
        super().__init__(state, req)
        self.finish: str | None = None
        self.called = False  # (streamed) a tool call to run was sent
        self.blocks = Blocks()

    @staticmethod
    def parse(body: Any, defaults: GenerateParams) -> TurnRequest:
        return parse_messages(body, defaults)

    def start(self) -> Iterable[str]:
        yield event("message_start", {"message": message(self.id, self.lease.model, [], (None, None), None)})
        yield event("ping", {})

    def piece(self, kind: PieceKind, value: Any, read: Logprobs | None) -> Iterable[str]:
        self.called = self.called or (kind == PieceKind.TOOL_CALL and value.error is None)
        return self.blocks.feed(kind, value)

    def done(self, index: int, stream: AsyncResponseStream, finish: str | None, read: Logprobs | None) -> None:
        self.finish = finish

    def closed(self, index: int, finish: str | None, read: Logprobs | None) -> Iterable[str]:
        if self.blocks.index < 0:  # an empty reply still has its (empty) text block
            yield from self.blocks.feed(PieceKind.TEXT, "")
        yield from self.blocks.close()
        stop = stop_reason(finish, self.called, _stop_sequence(self.state.lm, self.lease, self.req))
        yield event("message_delta", {"delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                      "usage": usage(self.lease.stream.stats)})

    def end(self) -> Iterable[str]:
        yield event("message_stop", {})

    def error(self, exc: Exception) -> str:
        return event("error", error_body(exc)[1])

    async def body(self) -> Mapping[str, Any]:
        lease, reply = self.lease, reply_of(self.lease)
        stop = stop_reason(self.finish, _runnable(reply.tool_calls), _stop_sequence(self.state.lm, lease, self.req))
        return message(self.id, lease.model, content_blocks(reply), stop, lease.stream.stats)


async def create(state: ServerState, request: Request) -> Response:
    """Answer the conversation the request sends (its last user message, or its tool results)."""
    return await run_turn(state, MessagesCodec, request)


async def count_tokens(state: ServerState, request: Request) -> Response:
    """``{"input_tokens": N}``: the tokens of the prompt the request would have (tools included)."""
    req = parse_messages(await read_body(request), state.config.defaults, counting=True)
    state.models.select(req.model)  # an unknown adapter is a 404 here too (an adapter does not change the count)
    n = await state.sessions.count_tokens(req.instructions, req.history, req.added, req.params, tools=req.tools)
    return JSONResponse({"input_tokens": n})


def _runnable(calls: Any) -> bool:
    return any(c.error is None for c in calls)


def _stop_sequence(lm: LoadedModel, lease: Lease, req: TurnRequest) -> str | None:
    """The stop sequence that ended the reply, if one did (the first of them in what the model wrote)."""
    stops, stream = req.params.stop, lease.stream
    if stream.finish_reason != "stop" or not stops:
        return None
    text = lm.tokenizer.decode(list(stream.tokens))
    found = sorted((text.find(s), s) for s in stops if s in text)
    return found[0][1] if found else None


class Blocks:
    """The reply's pieces (``Deltas``) as content blocks: a block opens when the kind of piece changes;
    a thinking block ends with its signature, a tool call is one block with its input in one delta."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: PieceKind | None = None

    def feed(self, kind: PieceKind, value: Any) -> Iterator[str]:
        if kind == PieceKind.TOOL_CALL and value.error is not None:  # unreadable: the text it wrote, never a call
            kind, value = PieceKind.TEXT, value.text or ""
        if kind != self.kind or kind == PieceKind.TOOL_CALL:
            yield from self.close()
            self.index, self.kind = self.index + 1, kind
            yield event("content_block_start", {"index": self.index, "content_block": _start(kind, value)})
        if kind == PieceKind.TOOL_CALL:
            partial = {"type": "input_json_delta", "partial_json": _json(value)}
            yield event("content_block_delta", {"index": self.index, "delta": partial})
        elif kind == PieceKind.REASONING:
            yield event("content_block_delta", {"index": self.index, "delta": {"type": "thinking_delta",
                                                                                "thinking": value}})
        else:
            yield event("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": value}})

    def close(self) -> Iterator[str]:
        if self.kind == PieceKind.REASONING:
            yield event("content_block_delta", {"index": self.index, "delta": {"type": "signature_delta",
                                                                                "signature": SIGNATURE}})
        if self.kind is not None:
            yield event("content_block_stop", {"index": self.index})
        self.kind = None


def _start(kind: PieceKind, value: Any) -> dict[str, Any]:
    if kind == PieceKind.TOOL_CALL:
        return {**tool_use_block(value), "input": {}}
    if kind == PieceKind.REASONING:
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "text", "text": ""}


def _json(call: ToolCall) -> str:
    return json.dumps(call.arguments, ensure_ascii=False)


__all__ = ["Blocks", "MessagesCodec", "count_tokens", "create"]
