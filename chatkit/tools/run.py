"""Running one tool call on a thread of its own, so that the caller can stop waiting for it.

A sync function cannot be interrupted: when its time is up, or the loop waiting for it is stopped,
its thread is abandoned (a daemon thread, which runs on until the function returns, and whose result
is dropped). An async function runs on an event loop of its own on that thread and is cancelled.
The thread runs in a copy of the caller's ``contextvars`` context.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import mlx.core as mx

POLL = 0.02  # seconds between looks at the stop event while a tool runs
CANCEL_GRACE = 1.0  # seconds a cancelled async tool gets to finish its cleanup before it is left


class TimedOut(Exception):
    """The tool did not return in time (an async one was cancelled, a sync one left running)."""


class Stopped(Exception):
    """The wait was stopped from outside (an async tool was cancelled, a sync one left running)."""


class ToolRun:
    """One call of ``function(**arguments)`` on its own thread; :meth:`result` waits for it."""

    def __init__(self, function: Callable[..., Any], arguments: Mapping[str, Any], name: str) -> None:
        self.is_async = inspect.iscoroutinefunction(function)
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._value: Any = None
        self._error: BaseException | None = None
        self._task: tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None = None
        self._cancelled = False
        context = contextvars.copy_context()
        thread = threading.Thread(target=context.run, args=(self._work, function, dict(arguments)),
                                  name=f"chatkit-tool-{name}", daemon=True)  # daemon: an abandoned one never holds the exit
        thread.start()

    def result(self, timeout: float | None, stop: threading.Event | None) -> Any:
        """The function's value (or its exception), waiting at most ``timeout`` seconds and until
        ``stop`` is set: ``TimedOut`` / ``Stopped`` then (an async tool is cancelled first)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.wait(POLL if deadline is None else max(0.0, min(POLL, deadline - time.monotonic()))):
            if stop is not None and stop.is_set():
                self._cancel()
                raise Stopped
            if deadline is not None and time.monotonic() >= deadline:
                self._cancel()
                raise TimedOut
        if self._error is not None:
            raise self._error
        return self._value

    def _work(self, function: Callable[..., Any], arguments: dict[str, Any]) -> None:
        try:
            self._value = asyncio.run(self._main(function, arguments)) if self.is_async else function(**arguments)
        except BaseException as exc:  # handed to the waiting thread (CancelledError included)
            self._error = exc
        finally:
            self._done.set()
            mx.clear_streams()  # MLX wants a thread's streams destroyed before the thread ends

    async def _main(self, function: Callable[..., Any], arguments: dict[str, Any]) -> Any:
        task = asyncio.current_task()
        assert task is not None
        with self._lock:
            if self._cancelled:
                raise asyncio.CancelledError
            self._task = (asyncio.get_running_loop(), task)
        return await function(**arguments)

    def _cancel(self) -> None:
        """Cancel an async tool and give it ``CANCEL_GRACE`` to unwind; a sync one is left running."""
        if not self.is_async:
            return
        with self._lock:
            self._cancelled = True
            task = self._task
        if task is not None:
            loop, running = task
            try:
                loop.call_soon_threadsafe(running.cancel)
            except RuntimeError:  # its loop has closed: the tool has ended
                return
        self._done.wait(CANCEL_GRACE)


__all__ = ["Stopped", "TimedOut", "ToolRun"]
