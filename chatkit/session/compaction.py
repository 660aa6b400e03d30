"""The next compaction, prepared between turns: once the context passes the policy's high-water mark, the
window the next compaction will use is chosen (its summary written) and the compacted context prefilled
into a spare cache, so that the turn that crosses the window prefills only its own message.

A preparation works on a snapshot and never holds the session: a turn that comes meanwhile waits for it
(``fallback="wait"``) or compacts without a new summary (``"rolling"``). It stays good while the history
only grows and the window is unchanged (preparing again then only tops its cache up with the new
exchanges); undo, regenerate or another compaction make it stale.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..cache.state import CacheState
from ..messages import ChatMessage
from ..params import GenerateParams
from .context import Window

WAIT = 600.0  # seconds a turn waits for a running preparation (fallback="wait") before compacting itself


@dataclass(frozen=True)
class Prepared:
    """A compaction prepared for ``messages`` seen through ``window``: the ``compacted`` window and a cache
    that holds its rendering."""

    messages: tuple[ChatMessage, ...]
    window: Window
    compacted: Window
    cache: CacheState


@dataclass(frozen=True)
class Snapshot:
    """What a preparation starts from: the conversation as it was, and the cache to fill (a still good
    preparation's, or a copy of the conversation's)."""

    messages: tuple[ChatMessage, ...]
    window: Window
    params: GenerateParams
    earlier: Prepared | None
    spare: CacheState


class Preparer:
    """A session's prepared compaction: at most one, and whether one is being made."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._prepared: Prepared | None = None

    @property
    def running(self) -> bool:
        return not self._idle.is_set()

    def start(self) -> bool:
        """Claim the right to prepare (False: another preparation is running)."""
        with self._lock:
            if not self._idle.is_set():
                return False
            self._idle.clear()
            return True

    def finish(self, prepared: Prepared | None) -> None:
        """A preparation ended (with a result, or ``None`` when it had nothing to do or failed)."""
        with self._lock:
            if prepared is not None:
                self._prepared = prepared
            self._idle.set()

    def wait(self, timeout: float = WAIT) -> None:
        """Until no preparation runs (at most ``timeout`` seconds)."""
        self._idle.wait(timeout)

    def get(self, messages: tuple[ChatMessage, ...], window: Window) -> Prepared | None:
        """The prepared compaction if it was made for this window and a history ``messages`` extends (a
        stale one is dropped)."""
        with self._lock:
            prepared = self._prepared
            n = 0 if prepared is None else len(prepared.messages)
            if prepared is not None and (prepared.window != window or messages[:n] != prepared.messages):
                prepared = self._prepared = None
            return prepared

    def used(self) -> None:
        """A turn took the prepared compaction (its cache now belongs to the conversation)."""
        self.discard()

    def discard(self) -> None:
        """Forget the prepared compaction (its cache's memory is freed)."""
        with self._lock:
            self._prepared = None


__all__ = ["Prepared", "Preparer", "Snapshot", "WAIT"]
