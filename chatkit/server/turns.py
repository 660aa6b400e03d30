"""The one turn runner every API shares: ``run_turn(state, codec, request)`` reads the request, opens the
turn (``ServerState.open_turn``), gives the reply an id, and either streams it or runs it to its end;
it owns the chunk loop (settling, trace stamps, the finish reason, log-probabilities, the pieces a
client is sent (``Deltas``), an error after the headers going into the stream) once. Each API is a
:class:`Codec`: how its request reads, and how each stage of a turn looks on its wire. A new API is
one codec module and one route (``app.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any, ClassVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..params import GenerateParams
from ..session.aio import AsyncResponseStream
from ..text.reply import PieceKind
from . import trace
from .body import read_body
from .lease import Lease
from .logprobs import Logprobs
from .state import ServerState
from .wire import Deltas, TurnRequest, compaction_headers, new_id

Ended = str  # how a streamed reply ended: "done", "failed" (an error mid-stream) or "cancelled" (client gone)


class Codec:
    """One API's side of a turn. The runner calls, for a streamed reply: :meth:`start`, then per stream
    (:meth:`streams`: one, or chat completions' ``n`` choices) :meth:`opened`, :meth:`piece` per piece,
    :meth:`done` once the stream closed (the turn committed) and :meth:`closed`; then :meth:`end` (before
    the turn settles) and :meth:`after` (once it settled, however it ended); an exception after the
    headers is :meth:`error` in the stream. For a reply that is not streamed: :meth:`done` per stream,
    then :meth:`body`. Each hook that sends something returns the server-sent events' text."""

    prefix: ClassVar[str] = "turn"  # the reply's id: ``<prefix>_<hex>``

    def __init__(self, state: ServerState, req: TurnRequest) -> None:
        self.state, self.req = state, req
        self.lease: Lease  # set once the turn is open (``open``)
        self.id = ""  # the reply's id, given once the turn is open

    @staticmethod
    def parse(body: Any, defaults: GenerateParams) -> TurnRequest:
        """The request body as a ``TurnRequest``; ``BadRequestError`` (400) for anything wrong in it."""
        raise NotImplementedError

    async def open(self) -> Lease:
        """Open the turn: answer ``added`` after ``instructions`` + ``history`` on the model the request names."""
        req = self.req
        return await self.state.open_turn(req, req.instructions, req.history, req.added)

    async def streams(self) -> AsyncIterator[tuple[int, AsyncResponseStream]]:
        """The reply's streams, each read (and closed) by the runner before the next is asked for."""
        yield 0, self.lease.stream

    def reader(self) -> Logprobs | None:
        """A stream's log-probability reader, when the request asks for them."""
        n = self.req.logprobs
        return Logprobs(self.state.lm.tokenizer, n) if n is not None else None

    def start(self) -> Iterable[str]:
        return ()

    def opened(self, index: int) -> Iterable[str]:
        return ()

    def piece(self, kind: PieceKind, value: Any, read: Logprobs | None) -> Iterable[str]:
        raise NotImplementedError

    def done(self, index: int, stream: AsyncResponseStream, finish: str | None, read: Logprobs | None) -> None:
        """A stream ended and was closed (its turn committed, or not): note what the reply needs of it."""

    def closed(self, index: int, finish: str | None, read: Logprobs | None) -> Iterable[str]:
        return ()

    def end(self) -> Iterable[str]:
        return ()

    async def after(self, ended: Ended) -> Iterable[str]:
        """(Shielded, once the turn settled, however the stream ended) what is sent last; nothing
        unless it is "done"."""
        return ()

    def error(self, exc: Exception) -> str:
        raise NotImplementedError

    async def body(self) -> Mapping[str, Any]:
        """The reply as one JSON object (after :meth:`done` of every stream, the turn settled)."""
        raise NotImplementedError


async def run_turn(state: ServerState, api: type[Codec], request: Request) -> Response:
    """Answer ``request`` with the API ``api``: its reply streamed, or as one JSON object."""
    codec = api(state, api.parse(await read_body(request), state.config.defaults))
    lease = codec.lease = await codec.open()
    codec.id = new_id(api.prefix)
    if codec.req.stream:
        return StreamingResponse(_events(state, codec), media_type="text/event-stream")
    async with state.settled(lease):
        async for index, stream in codec.streams():
            read, finish = codec.reader(), None
            async with stream:  # closed (committed) however the block ends
                async for chunk in stream:
                    finish = chunk.finish_reason
                    if read is not None:
                        read.feed(chunk)
            codec.done(index, stream, finish, read)
    body = await codec.body()
    return JSONResponse(body, headers=compaction_headers(lease.compaction()))


async def _events(state: ServerState, codec: Codec) -> AsyncIterator[str]:
    """The reply as server-sent events (see :class:`Codec` for the order)."""
    ended: Ended = "cancelled"  # until the stream ends or fails
    tail: Iterable[str] = ()
    try:
        async with state.settled(codec.lease):
            try:
                for text in codec.start():
                    yield text
                async for index, stream in codec.streams():
                    async for text in _stream(codec, index, stream):
                        yield text
                for text in codec.end():
                    yield text
                ended = "done"
            except Exception as exc:  # after the headers: the error goes into the stream
                ended = "failed"
                yield codec.error(exc)
    finally:  # also when the client went away
        tail = await codec.after(ended)
    for text in tail:
        yield text


async def _stream(codec: Codec, index: int, stream: AsyncResponseStream) -> AsyncIterator[str]:
    """One stream's events: opened, its pieces, closed."""
    for text in codec.opened(index):
        yield text
    finish, deltas, read = None, Deltas(), codec.reader()
    trace.stamp("turn")
    async with stream:  # closed (committed) however the block ends
        async for chunk in stream:
            trace.stamp("token")
            finish = chunk.finish_reason
            if read is not None:
                read.feed(chunk)
            for kind, value in deltas.feed(chunk):
                if kind == PieceKind.TEXT and value:
                    trace.stamp("text")
                for text in codec.piece(kind, value, read):
                    yield text
        for kind, value in deltas.end():
            for text in codec.piece(kind, value, read):
                yield text
    codec.done(index, stream, finish, read)
    for text in codec.closed(index, finish, read):
        yield text


__all__ = ["Codec", "run_turn"]
