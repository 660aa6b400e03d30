"""Writing each conversation's cache behind its turn (``--store``), so that a crash (``kill -9``, a
power cut) loses at most the turns in flight, not every cache saved only at a graceful shutdown.

A turn's end schedules the write of its conversation ``SAVE_DELAY`` seconds later, after the reply
was sent: a conversation that goes on within that time (a client re-sending at once, a tool round)
has its turns coalesced into one write. The write runs off the event loop on the server's one worker
(the thread of all its blocking MLX work, in the order it is asked for), and atomically
(``save_cache``: a temporary file renamed over the last one). A turn on a conversation being written
waits for its write (a moment), never gets a 409.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger("chatkit.server")
SAVE_DELAY = 0.5  # seconds a conversation stays idle before its cache is written: rapid turns coalesce

Job = Callable[[], None]


class WriteBehind:
    """Schedules the writes of conversations' caches and hands them to ``submit``.

    ``prepare(conv)`` is called on the event loop when ``conv``'s write is due: it returns the blocking
    job to run, or ``None`` to write nothing now (it may :meth:`touch` again). ``submit(job)`` queues the
    job on the server's worker and returns its future (``SessionIndex``'s). Every method runs on the
    event loop.
    """

    def __init__(self, prepare: Callable[[str], Job | None], submit: Callable[[Job], asyncio.Future[None]]) -> None:
        self._prepare, self._submit = prepare, submit
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._running: dict[str, asyncio.Future[None]] = {}

    def touch(self, conv: str) -> None:
        """``conv`` changed: write it once it has been left alone for ``SAVE_DELAY`` seconds."""
        self.cancel(conv)
        self._timers[conv] = asyncio.get_running_loop().call_later(SAVE_DELAY, self._due, conv)

    def cancel(self, conv: str) -> None:
        """Forget ``conv``'s pending write (it was removed); one already running ends as it would."""
        timer = self._timers.pop(conv, None)
        if timer is not None:
            timer.cancel()

    def writing(self, conv: str) -> bool:
        """Whether ``conv`` is being written right now."""
        return conv in self._running

    async def wait(self, conv: str | None) -> None:
        """Until ``conv``'s running write (if any) has ended; its failure was logged, not raised."""
        future = self._running.get(conv) if conv is not None else None
        if future is not None:
            await asyncio.wait([future])

    async def close(self) -> None:
        """Drop the pending writes (a graceful shutdown saves everything), finish the running ones."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        if self._running:
            await asyncio.wait(list(self._running.values()))

    def _due(self, conv: str) -> None:
        self._timers.pop(conv, None)
        if conv in self._running:  # cannot happen (a turn waits for its write), but never two at once
            self.touch(conv)
            return
        job = self._prepare(conv)
        if job is None:
            return
        future = self._submit(job)
        self._running[conv] = future
        future.add_done_callback(lambda done: self._done(conv, done))

    def _done(self, conv: str, future: asyncio.Future[None]) -> None:
        if self._running.get(conv) is future:
            del self._running[conv]
        if not future.cancelled() and future.exception() is not None:
            log.warning("conversation %s: cache not written behind its turn (%s); it is written at the next "
                        "turn or at shutdown", conv, future.exception())


__all__ = ["SAVE_DELAY", "WriteBehind"]
