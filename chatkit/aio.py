"""Async streaming: a turn's MLX work runs on the session's worker thread; chunks reach the event loop."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Executor
from typing import Any

from .stream import ResponseStream, StreamChunk, TurnStats

_END = object()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class AsyncResponseStream:
    """The reply of one turn for ``async for``; use it as an async context manager.

    Generation runs on the session's worker thread (all of a turn's MLX work on one thread) and never
    blocks the event loop. Cancelling the consuming task, ``await stream.aclose()`` or leaving the
    ``async with`` block stops generation within one decode step and commits the reply as far as it
    got, like closing a synchronous stream.
    """

    def __init__(self, stream: ResponseStream, executor: Executor) -> None:
        self._stream = stream
        self._executor = executor
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
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, _Failure):
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
        self._done = asyncio.wrap_future(self._executor.submit(self._pump))

    def _pump(self) -> None:
        """Worker thread: iterate the synchronous stream, hand chunks to the loop, commit at the end."""
        try:
            for chunk in self._stream:
                self._put(chunk)
                if self._cancel.is_set():
                    break
        except BaseException as exc:  # the stream has rolled the turn back; the consumer re-raises
            self._put(_Failure(exc))
            return
        finally:
            self._stream.close()
        self._put(_END)

    def _put(self, item: Any) -> None:
        assert self._loop is not None and self._queue is not None
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is gone; the turn is committed anyway


__all__ = ["AsyncResponseStream"]
