"""Async streaming: a turn's MLX work runs on a worker thread of its own; chunks reach the event loop."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from .results import StreamChunk
from .streams import GuidedStream, ReplyStream
from .tool_loop import ToolLoopStream

END = object()  # what pump() hands over after the last chunk
After = Callable[[], "Callable[[], None] | None"]  # after a turn: the work to run between turns, if any
LOOKAHEAD = 2  # chunks a worker may compute before the consumer takes them (once the first text is out)
IDLE_SECONDS = 30.0  # how long a worker thread whose turn ended waits for the next turn
POLL = 0.25  # seconds between an idle worker's checks that the program goes on
Job = Callable[[], "Callable[[], None] | None"]  # a worker's job; what it returns is called once the thread is idle


class Failure:
    """What pump() hands over when the turn raised; the turn is rolled back already."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Drop:
    """Whether a stream stopped before its end is discarded rather than committed: told so
    (``adiscard``), or its ``keep`` predicate (``discard_unless``) says no. Read on the worker thread."""

    def __init__(self) -> None:
        self.told = threading.Event()
        self.keep: Callable[[], bool] | None = None

    def __call__(self) -> bool:
        keep = self.keep
        return self.told.is_set() or (keep is not None and not keep())


def pump(
    stream: ReplyStream,
    put: Callable[[Any], None],
    cancel: threading.Event,
    credits: threading.Semaphore,
    consumer_alive: Callable[[], bool],
    drop: Callable[[], bool] = lambda: False,
) -> None:
    """Iterate ``stream`` on this (worker) thread, handing each chunk to ``put``, then ``END`` or a
    ``Failure``. Each chunk waits for one of ``credits`` (the consumer gives one back per chunk it
    takes), so the turn never runs more than that many chunks ahead of what was shown. Setting
    ``cancel`` (and releasing ``credits``), or the consumer going away, stops it before the next
    token; the turn commits, unless ``drop()`` then says to discard it."""
    try:
        chunks = iter(stream)
        while not cancel.is_set():
            if not _may_go_on(credits, cancel, consumer_alive):
                break
            chunk = next(chunks, None)
            if chunk is None:
                break
            put(chunk)
    except BaseException as exc:
        put(Failure(exc))
        return
    finally:
        stream.discard() if drop() else stream.close()
    put(END)


def _may_go_on(credits: threading.Semaphore, cancel: threading.Event, consumer_alive: Callable[[], bool]) -> bool:
    """Wait for a credit; False once cancelled or once nobody will ever take another chunk."""
    while not credits.acquire(timeout=0.1):
        if cancel.is_set() or not consumer_alive():
            return False
    return not cancel.is_set()


class AsyncResponseStream:
    """The reply of one turn for ``async for`` (with tools, of every round: it wraps the session's
    ``ToolLoopStream``); use it as an async context manager.

    Generation runs on a worker thread started for the turn (all of its MLX work on that thread) and
    never blocks the event loop; it stays at most ``LOOKAHEAD`` chunks ahead of the consumer. Until
    the consumer has come back for more after the first chunk with text, the worker computes one
    chunk at a time (it waits while the consumer handles a chunk): the worker's Python work on the
    next token would otherwise hold the interpreter lock the consumer needs to pass the first text
    on (up to ``sys.getswitchinterval()``, 5 ms, each time it needs it).
    Cancelling the consuming task, ``await stream.aclose()`` or leaving the ``async with`` block stops
    generation within one decode step and commits the reply as far as it got: what the consumer
    took, plus at most those few chunks. ``await stream.adiscard()`` stops it and commits nothing,
    and :meth:`discard_unless` makes every such stop a discard while its predicate is false.
    """

    def __init__(self, stream: ReplyStream, stop: threading.Event | None = None, after: After | None = None) -> None:
        """``stop``: an event to set when the turn is told to stop (the session waits on its commit);
        ``after``: called on the worker once the turn has ended, before the caller hears of it; the work
        it returns (preparing the next compaction) runs after, while the caller goes on."""
        self._after = after
        self._stream = stream
        self._cancel = stop if stop is not None else threading.Event()
        self._credits = threading.Semaphore(1)  # one chunk at a time until the first text is out
        self._paced = True  # ... which lasts until the consumer asks again after a chunk with text
        self._shown = False  # a chunk with text was taken
        self._queue: asyncio.Queue[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Future[None] | None = None
        self._ended = False  # END or a failure was handed out: iteration is over
        self._drop = Drop()

    # The surface every stream has (``ReplyStream``), read from the stream the worker iterates.
    text = property(lambda self: self._stream.text, doc="The answer so far (see ``ReplyStream``).")
    reasoning = property(lambda self: self._stream.reasoning, doc="The reasoning so far.")
    tool_calls = property(lambda self: self._stream.tool_calls, doc="The tool calls completed so far.")
    tokens = property(lambda self: self._stream.tokens, doc="Token ids generated so far.")
    finish_reason = property(lambda self: self._stream.finish_reason, doc="Why the reply ended, once it has.")
    stats = property(lambda self: self._stream.stats, doc="The turn's ``TurnStats`` once closed.")
    closed = property(lambda self: self._stream.closed, doc="Whether the reply has ended.")
    rounds = property(lambda self: self._stream.rounds, doc="With tools, how many replies the model has given (else 1).")
    tool_results = property(lambda self: self._stream.tool_results, doc="With tools, the tool messages chatkit added.")

    discarded = property(lambda self: self._stream.discarded, doc="Whether the turn was discarded.")

    @property
    def shown(self) -> bool:
        """Whether a chunk with text (answer, reasoning or a tool call's) was handed to the consumer."""
        return self._shown

    def result(self) -> Any:
        """The reply's result once it has ended: its text (a guided reply: its value)."""
        return self._stream.result()

    def discard_unless(self, keep: Callable[[], bool]) -> None:
        """When the stream is stopped before its end (cancelled, closed, dropped), discard the turn
        instead of committing it if ``keep()`` is false then (called on the worker thread): a server
        keeps a reply only once some of it reached its client. Keep ``keep`` free of references to
        this stream (a dropped stream must be collectable)."""
        self._drop.keep = keep

    async def adiscard(self) -> None:
        """Stop generating and commit nothing (``ReplyStream.discard``); returns once the turn is
        settled. A turn that has already committed stays committed."""
        self._drop.told.set()
        await self.aclose()

    def __aiter__(self) -> AsyncResponseStream:
        return self

    async def __anext__(self) -> StreamChunk:
        if self._ended:
            raise StopAsyncIteration
        if self._queue is None:
            self.start()
        elif self._shown and self._paced:  # the first text was handled: the worker may run ahead now
            self._paced = False
            self._credits.release(LOOKAHEAD)
        assert self._queue is not None
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self._stop()  # the worker stops after the token it is computing
            raise
        if not self._paced:
            self._credits.release()
        elif isinstance(item, StreamChunk) and item.text:
            self._shown = True  # the next chunk is computed once the consumer asks for it
        else:
            self._credits.release()
        if item is END:
            self._ended = True
            raise StopAsyncIteration
        if isinstance(item, Failure):
            self._ended = True
            raise item.exc
        return item

    async def aclose(self) -> None:
        """Stop generating and commit what was produced; returns once the turn is committed."""
        self._stop()
        if self._done is None:  # never started: no MLX work to move to the worker
            self._stream.discard() if self._drop() else self._stream.close()
            return
        await asyncio.shield(self._done)

    async def __aenter__(self) -> AsyncResponseStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # Dropped without aclose() (e.g. a `break` outside `async with`): the worker, which holds no
        # reference to this object, stops and the turn commits, as a dropped ResponseStream does.
        self._stop()

    def _stop(self) -> None:
        self._cancel.set()
        self._credits.release()  # wakes a worker waiting for the consumer
        if isinstance(self._stream, ToolLoopStream):
            self._stream.interrupt()  # a worker waiting for a tool stops waiting (an async tool is cancelled)

    def start(self) -> None:
        """Start generating now, on the worker thread, rather than when ``async for`` first asks: the
        prompt's prefill then overlaps with what the caller does before it reads (a server sending its
        response's headers). The worker computes the first chunk and waits for the consumer; closing
        the stream before reading it commits what was generated by then (at most that chunk). Call it on the event loop that will read the
        stream; once started (or read), calling it again does nothing."""
        if self._queue is not None:
            return
        self._loop = loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._done = loop.create_future()
        args = (self._stream, loop, self._queue, self._done, self._cancel, self._credits, self._after, self._drop)
        WORKERS.run(lambda: _work(*args))


def _work(stream: ReplyStream, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, done: asyncio.Future,
          cancel: threading.Event, credits: threading.Semaphore,
          after: After | None = None, drop: Drop | None = None) -> Callable[[], None] | None:
    """A turn on its worker thread: pump the stream into the event loop's queue, then run ``after``
    (between turns: the caller is not waiting for it). Resolves ``done`` before that work, or (no
    work) returns how to resolve it once the thread waits for the next turn, which then runs on it."""
    # A closed event loop takes no more chunks (e.g. asyncio.run() returned while a stream was
    # still referenced): the turn stops and commits instead of blocking the process's exit.
    # So does the main thread's end (the interpreter then joins this thread before anything else).
    try:
        pump(stream, lambda item: _call(loop, queue.put_nowait, item), cancel, credits,
             lambda: not loop.is_closed() and threading.main_thread().is_alive(), drop or (lambda: False))
        work = after() if after is not None else None
    except BaseException:
        _call(loop, done.set_result, None)
        raise
    if work is None:
        return lambda: _call(loop, done.set_result, None)
    _call(loop, done.set_result, None)
    work()
    return None


class Workers:
    """The threads turns run on. A thread whose turn ended waits up to ``IDLE_SECONDS`` for the next
    turn (a thread's first MLX work costs milliseconds more than its next: MLX and BLAS set up per
    thread), then ends, its MLX streams cleared; it ends sooner once the main thread has (the
    interpreter joins it at exit). Turns at once each get a thread: one waiting for its consumer
    never holds up another."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._idle = 0  # threads waiting for a job that no job has claimed yet

    def run(self, job: Job) -> None:
        """Run ``job`` on an idle worker thread, or on a new one; what it returns, if anything, is
        called once the thread is ready for the next job."""
        with self._lock:
            if self._idle:
                self._idle -= 1  # claimed: one of the waiting threads takes it
                self._jobs.put(job)
                return
        threading.Thread(target=self._serve, args=(job,), name="chatkit-turn", daemon=False).start()

    def _serve(self, job: Job | None) -> None:
        try:
            while job is not None:
                job = self._next(job())
        finally:
            mx.clear_streams()  # MLX wants a thread's streams destroyed before the thread ends

    def _next(self, then: Callable[[], None] | None) -> Job | None:
        """The next job (``then`` called once this thread is ready for it), or ``None`` once it may end."""
        with self._lock:
            self._idle += 1
        if then is not None:
            then()
        waited = 0.0
        while True:
            try:
                return self._jobs.get(timeout=POLL)
            except queue.Empty:
                waited += POLL
            if waited >= IDLE_SECONDS or not threading.main_thread().is_alive():
                with self._lock:
                    if self._idle:  # more threads wait than jobs are on their way: this one may go
                        self._idle -= 1
                        return None  # else a job was claimed meanwhile: it is this thread's to take


WORKERS = Workers()


def _call(loop: asyncio.AbstractEventLoop, fn: Callable[[Any], Any], arg: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:
        pass  # the event loop is gone; the turn is committed anyway


class AsyncGuidedStream(AsyncResponseStream):
    """An :class:`AsyncResponseStream` over a guided reply: ``partial`` and ``value`` too."""

    def __init__(self, stream: GuidedStream, stop: threading.Event | None = None, after: After | None = None) -> None:
        super().__init__(stream, stop=stop, after=after)
        self._guided = stream

    @property
    def partial(self) -> Any:
        """The latest partial value (see ``GuidedStream.partial``)."""
        return self._guided.partial

    @property
    def value(self) -> Any:
        """The final value once the stream has ended (see ``GuidedStream.value``)."""
        return self._guided.value


__all__ = ["AsyncGuidedStream", "AsyncResponseStream"]
