"""``TurnGate``: one turn at a time per session, and a tool loop's hold on its session between rounds."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import SessionBusyError

STOPPING_TURN_WAIT = 60.0  # seconds; a stopping async turn may still be finishing a prefill chunk


class LoopHold:
    """An open tool loop's hold on its session; ``ended`` is set once the loop is over."""

    def __init__(self) -> None:
        self.ended = threading.Event()


class TurnGate:
    """The turn lock of a session: held from the start of a turn until it commits or aborts, and for
    short edits. An open tool loop (a :class:`LoopHold`) keeps the session between its rounds too:
    only that loop's own rounds and edits get through. A refused call raises ``SessionBusyError`` and
    changes nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: LoopHold | None = None
        self.async_stop: threading.Event | None = None  # set once the last async turn was told to stop

    @property
    def busy(self) -> bool:
        """Whether a turn is in progress (a stream is open; with tools, until its last round ends)."""
        return self._lock.locked() or self._loop is not None

    def take(self, loop: LoopHold | None = None) -> bool:
        """Take the turn lock, unless a tool loop other than ``loop`` holds the session. An async turn
        that was told to stop (cancelled, closed, or its stream dropped) commits on its worker within a
        decode step, and its tool loop ends after that round: wait for that rather than fail."""
        stop = self.async_stop
        stopping = stop is not None and stop.is_set()
        if not self._lock.acquire(blocking=False) and not (stopping and self._lock.acquire(timeout=STOPPING_TURN_WAIT)):
            return False
        holder = self._loop
        if holder is None or holder is loop:
            return True
        self._lock.release()
        return stopping and holder.ended.wait(STOPPING_TURN_WAIT) and self.take(loop)

    def take_turn(self, loop: LoopHold | None = None) -> None:
        """Take the lock for a turn (released by :meth:`release` when it settles)."""
        if not self.take(loop):
            raise SessionBusyError("This session already has a turn in progress: finish or close its stream first.")

    def release(self) -> None:
        self._lock.release()

    @contextmanager
    def idle(self, action: str, loop: LoopHold | None = None) -> Iterator[None]:
        """Hold the lock for a short edit; ``SessionBusyError`` while a stream is open (``loop``: the
        tool loop making the edit, which holds the session)."""
        if not self.take(loop):
            raise SessionBusyError(f"Cannot {action} while a reply is streaming: close the stream first.")
        try:
            yield
        finally:
            self._lock.release()

    def hold(self) -> LoopHold:
        """A tool loop starts: it holds the session until :meth:`let_go`."""
        hold = LoopHold()
        with self.idle("start a reply"):
            self._loop = hold
        return hold

    def let_go(self, hold: LoopHold) -> None:
        """The tool loop ``hold`` is over."""
        if self._loop is hold:
            self._loop = None
        hold.ended.set()


__all__ = ["LoopHold", "TurnGate"]
