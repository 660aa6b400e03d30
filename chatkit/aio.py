"""Async streaming: a turn's MLX work runs on a worker thread of its own; chunks reach the event loop."""

from __future__ import annotations

import asyncio
import threading

import mlx.core as mx
from typing import Any, Callable

from .stream import ResponseStream, StreamChunk, TurnStats

END = object()  # what pump() hands over after the last chunk


class Failure:
    """What pump() hands over when the turn raised; the turn is rolled back already."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def pump(stream: ResponseStream, put: Callable[[Any], None], cancel: threading.Event) -> None:
    """Iterate ``stream`` on this (worker) thread, handing each chunk to ``put``, then ``END`` or a
    ``Failure``. Setting ``cancel`` stops it after the token being computed; the turn commits."""
    try:
        for chunk in stream:
            put(chunk)
            if cancel.is_set():
                break
    except BaseException as exc:
        put(Failure(exc))
        return
    finally:
        stream.close()
    put(END)


class AsyncResponseStream:
    """The reply of one turn for ``async for``; use it as an async context manager.

    Generation runs on a worker thread started for the turn (all of its MLX work on that thread) and
    never blocks the event loop. Cancelling the consuming task, ``await stream.aclose()`` or leaving the
    ``async with`` block stops generation within one decode step and commits the reply as far as it
    got, like closing a synchronous stream.
    """

    def __init__(self, stream: ResponseStream) -> None:
        self._stream = stream
        self._cancel = threading.Event()
        self._queue: asyncio.Queue[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Future[None] | None = None

    @property
    def text(self) -> str:
        return self._stream.text

    @property
    def tokens(self) -> list[int]:
        return self._stream.tokens

    @property
    def stats(self) -> TurnStats | None:
        return self._stream.stats

    @property
    def closed(self) -> bool:
        return self._stream.closed

    def __aiter__(self) -> "AsyncResponseStream":
        return self

    async def __anext__(self) -> StreamChunk:
        if self._queue is None:
            self._start()
        assert self._queue is not None
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self._cancel.set()  # the worker stops after the token it is computing
            raise
        if item is END:
            raise StopAsyncIteration
        if isinstance(item, Failure):
            raise item.exc
        return item

    async def aclose(self) -> None:
        """Stop generating and commit what was produced; returns once the turn is committed."""
        self._cancel.set()
        if self._done is None:
            self._stream.close()  # never started: no MLX work to move to the worker
            return
        await asyncio.shield(self._done)

    async def __aenter__(self) -> "AsyncResponseStream":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._done = self._loop.create_future()
        threading.Thread(target=self._work, name="chatkit-turn", daemon=False).start()

    def _work(self) -> None:
        try:
            pump(self._stream, self._put, self._cancel)
        finally:
            mx.clear_streams()  # MLX wants a thread's streams destroyed before the thread ends
            self._call(self._done.set_result, None)

    def _put(self, item: Any) -> None:
        assert self._queue is not None
        self._call(self._queue.put_nowait, item)

    def _call(self, fn: Callable[[Any], Any], arg: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:
            pass  # the event loop is gone; the turn is committed anyway


__all__ = ["AsyncResponseStream", "END", "Failure", "pump"]
