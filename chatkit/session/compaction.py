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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..cache.state import CacheState
from ..errors import ChatKitError
from ..messages import ChatMessage
from ..params import GenerateParams
from .context import ContextPolicy, Fitter, Window
from .conversation import Conversation
from .gate import TurnGate

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


@dataclass
class Compactor:
    """A session's compactions prepared ahead (see the module docstring). The session holds one and is seen
    only through these: its ``gate``, its current ``conversation``, ``policy`` and sampling ``params``, its
    ``fitter`` (with summaries), how it ``render`` s a window and ``fill`` s a cache, and whether it ``can``
    prepare at all (one process, no images, a policy that compacts). ``between_turns``: runs work between
    turns (a pool's worker), else nothing is prepared by itself."""

    gate: TurnGate
    conversation: Callable[[], Conversation]
    policy: Callable[[], ContextPolicy]
    params: Callable[[], GenerateParams]
    fitter: Callable[[GenerateParams], Fitter]
    render: Callable[[Window, Sequence[ChatMessage], GenerateParams], list[int]]
    fill: Callable[[CacheState, list[int]], None]
    can: Callable[[], bool]
    preparer: Preparer = field(default_factory=Preparer)
    between_turns: Callable[[Callable[[], None]], None] | None = None

    def prepared(self) -> Prepared | None:
        """The compaction prepared for the conversation as it is, if any (``fallback="wait"``: after the
        preparation running now has ended)."""
        if self.preparer.running:
            if self.policy().fallback != "wait":
                return None  # still being made (its cache too): this turn compacts by itself
            self.preparer.wait()
        c = self.conversation()
        return self.preparer.get(c.messages, c.window)

    def claim(self) -> Callable[[], None] | None:
        """After an async turn, before its caller hears of the end: claim the next compaction's preparation
        and take its snapshot (so the next turn waits for it, or knows it is coming), and return the work,
        which runs between turns. A failure there is the next turn's to report (it compacts by itself, and
        a summarizer that fails raises then, changing nothing)."""
        try:
            snapshot = self._claim()
        except ChatKitError:
            return None
        if snapshot is None:
            return None

        def work() -> None:
            try:
                self._prepare_from(snapshot)
            except ChatKitError:
                pass
        return work

    def after_turn(self) -> None:
        """When work runs between turns (``between_turns``): claim the next compaction's preparation now,
        as the turn ends (so a turn that comes next knows it is coming), and hand the work over. Never
        raises: the turn has committed, and the next one compacts by itself."""
        run = self.between_turns
        if run is None or self.gate.busy:  # a tool loop between its rounds: prepared once it ends
            return
        try:
            work = self.claim()
        except Exception:  # a preparation is only a saving
            return
        if work is not None:
            try:
                run(work)
            except Exception:  # it will not run: the next turn must not wait for it
                self.preparer.finish(None)

    def prepare(self) -> bool:
        """See ``ChatSession.prepare_compaction``."""
        snapshot = self._claim()
        return False if snapshot is None else self._prepare_from(snapshot)

    def _claim(self) -> Snapshot | None:
        """Claim the next compaction's preparation and take its snapshot: ``None`` when there is nothing to
        prepare or one is running (a snapshot that fails releases the claim and raises)."""
        if not self.can() or not self.preparer.start():
            return None
        try:
            return self._snapshot()
        except BaseException:
            self.preparer.finish(None)
            raise

    def _snapshot(self) -> Snapshot:
        """What a preparation works on, taken while no turn runs; its own work does not hold the session."""
        with self.gate.idle("prepare a compaction"):
            c = self.conversation()
            earlier = self.preparer.get(c.messages, c.window)
            spare = earlier.cache if earlier is not None else c.cache.copy()
            return Snapshot(c.messages, c.window, self.params().copy(), earlier, spare)

    def _prepare_from(self, s: Snapshot) -> bool:
        """Prepare from a snapshot (a still good preparation: only top its cache up with the exchanges
        since); the preparer is told the outcome whatever happens."""
        prepared = None
        try:
            compacted = s.earlier.compacted if s.earlier is not None else (
                self.fitter(s.params).ahead(s.window, s.messages, s.spare.ledger.opaque, self.policy().room(s.params.max_tokens)))
            ids = self.render(compacted, s.messages, s.params) if compacted is not None else []
            if compacted is not None and ids:  # (a conversation compacted to nothing has no prompt to prefill)
                self.fill(s.spare, ids)
                prepared = Prepared(s.messages, s.window, compacted, s.spare)
            return prepared is not None
        finally:
            self.preparer.finish(prepared)


__all__ = ["Compactor", "Prepared", "Preparer", "Snapshot", "WAIT"]
