"""``SessionPool``: many conversations over one loaded model, their KV caches kept under a byte budget,
and their next compactions prepared between turns."""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx

from .. import distributed
from ..cache import atomic
from ..decode.batch import BatchEngine, check_engine
from ..errors import CacheFileError, ChatKitError, InvalidParamsError, NoCacheAvailableError, SessionBusyError
from ..model.loaded import LoadedModel
from .builder import ChatSessionBuilder
from .session import ChatSession

Configure = Callable[[ChatSessionBuilder], ChatSessionBuilder]


class SessionPool:
    """Sessions by key over one model. When their caches pass ``max_cache_bytes``, the least recently
    used caches are saved to ``folder`` and released; a session gets its cache back when next used.

    ``configure`` sets up each new session's builder (instructions, params, ...). Get the session
    from the pool for each use (``pool.session(key)``), so the pool knows what is in use. A session
    built elsewhere (with a history, a restored cache, a fork) joins the pool with ``add``; ``get``
    looks one up without using it. With ``engine`` (a ``chatkit.BatchEngine`` over ``lm``) the
    sessions' concurrent turns decode together.

    A key is any non-empty str (``InvalidParamsError`` otherwise); its cache file is named by a hash
    of the key (:meth:`path`), so no key can name a file outside ``folder`` or one the file system
    refuses. Temporary files left in ``folder`` by saves that were killed are removed at start.

    Over a sharded model every rank makes the same pool calls; the budget applies to the rank whose
    caches are largest, so that every rank evicts the same sessions (each saves its own shard).

    With a context policy that compacts (``ContextPolicy.rolling`` / ``summarize``), a pooled session
    prepares its next compaction in the background after each turn (``session.prepare_compaction()``
    on a thread of the pool's), once its context passes the policy's high-water mark; a turn that comes
    meanwhile waits for it or compacts by itself (the policy's ``fallback``). ``wait_idle()`` waits
    for those preparations.
    """

    def __init__(
        self,
        lm: LoadedModel,
        *,
        folder: str | os.PathLike[str],
        max_cache_bytes: int,
        configure: Configure | None = None,
        engine: BatchEngine | None = None,
    ) -> None:
        if isinstance(max_cache_bytes, bool) or not isinstance(max_cache_bytes, int) or max_cache_bytes < 0:
            raise InvalidParamsError(f"max_cache_bytes={max_cache_bytes!r}: must be an int >= 0.")
        self._lm = lm
        self._folder = Path(os.path.expanduser(os.fspath(folder)))
        try:
            self._folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheFileError(
                f"SessionPool cannot use the folder {str(self._folder)!r}: {exc.strerror or exc}. "
                "Pass a folder it can create and write."
            ) from exc
        atomic.remove_stale_temps(self._folder)  # left by a process killed while it evicted
        self._budget = max_cache_bytes
        self._configure = configure
        check_engine(engine, lm.model if isinstance(lm, LoadedModel) else None)
        self._engine = engine
        self._sessions: OrderedDict[str, ChatSession] = OrderedDict()  # least recently used first
        self._evicted: set[str] = set()
        self._lock = threading.RLock()
        self._between = BetweenTurns()

    def session(self, key: str) -> ChatSession:
        """The session for ``key``, created on first use, its cache restored if it was evicted."""
        _check_key(key)
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                builder = ChatSession.builder(self._lm).engine(self._engine)
                session = (self._configure(builder) if self._configure else builder).build()
                self._sessions[key] = session
                session._compactor.between_turns = self._between.submit
            self._sessions.move_to_end(key)
            if key in self._evicted:
                self._evicted.discard(key)
                try:
                    session.restore_cache(self.path(key))
                except ChatKitError:
                    pass  # file gone or damaged: the transcript is the truth, the next turn re-prefills
            self.enforce_budget(keep=key)
            return session

    def get(self, key: str) -> ChatSession | None:
        """The session for ``key`` as it is (``None`` if there is none), to look at: it is neither
        created, nor marked as used, nor given back an evicted cache. Use ``session(key)`` to use it."""
        with self._lock:
            return self._sessions.get(key) if isinstance(key, str) else None

    def add(self, key: str, session: ChatSession) -> ChatSession:
        """Put ``session`` (built by the caller over the pool's model) in the pool under ``key`` as the
        most recently used, replacing the session there; returns it. ``SessionBusyError`` if the
        session it would replace is generating; ``InvalidParamsError`` for a session over another model."""
        _check_key(key)
        if not isinstance(session, ChatSession) or session.model is not self._lm:
            raise InvalidParamsError("SessionPool.add takes a ChatSession built over the pool's own model.")
        with self._lock:
            old = self._sessions.get(key)
            if old is not None and old is not session and old.busy:
                raise SessionBusyError(f"The session {key!r} is generating a reply: replace it once its stream is closed.")
            self._sessions[key] = session
            session._compactor.between_turns = self._between.submit
            self._sessions.move_to_end(key)
            self._evicted.discard(key)  # the new session's cache is in memory; a saved file is stale
            self.enforce_budget(keep=key)
            return session

    def enforce_budget(self, keep: str | None = None) -> list[str]:
        """Evict least recently used caches until the total fits the budget; returns the keys evicted.

        Busy sessions and ``keep`` are never evicted.
        """
        evicted = []
        with self._lock:
            for key, session in list(self._sessions.items()):
                if self.cache_bytes() <= self._budget:
                    break
                if key == keep or session.busy or _bytes(session) == 0:
                    continue
                try:
                    self._folder.mkdir(parents=True, exist_ok=True)  # it may have been removed
                except OSError:
                    pass  # then saving fails below, with a CacheFileError
                try:
                    session.save_cache(self.path(key), images=True)
                    self._evicted.add(key)
                except (SessionBusyError, NoCacheAvailableError):
                    continue  # busy meanwhile, or nothing to save: try the next one
                except ChatKitError:
                    pass  # the disk failed us, or its settings cannot be saved: still free the memory
                try:
                    session.release_cache()
                except ChatKitError:
                    self._evicted.discard(key)
                    continue  # a turn started meanwhile
                evicted.append(key)
        return evicted

    def cache_bytes(self) -> int:
        """Bytes held by the caches of the sessions in memory (checkpoints included); over a sharded
        model, the largest rank's (every rank must call this)."""
        with self._lock:
            local = sum(_bytes(s) for s in self._sessions.values())
        return distributed.largest(self._lm.distributed, local)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no compaction is being prepared in the background (at most ``timeout`` seconds);
        returns whether none is."""
        return self._between.wait(timeout)

    def evicted(self, key: str) -> bool:
        """Whether ``key``'s cache is on disk rather than in memory."""
        return isinstance(key, str) and key in self._evicted

    def remove(self, key: str) -> None:
        """Forget a conversation and delete its saved cache."""
        _check_key(key)
        with self._lock:
            self._sessions.pop(key, None)
            self._evicted.discard(key)
            try:
                Path(distributed.shard_path(self._lm.distributed, self.path(key))).unlink(missing_ok=True)
            except OSError as exc:
                raise CacheFileError(
                    f"Could not delete {str(self.path(key))!r}: {exc.strerror or exc}. Delete it by hand."
                ) from exc

    def path(self, key: str) -> Path:
        """Where ``key``'s cache is saved when evicted: a name made of a hash of the key, so that any
        str (a path, a lone surrogate) names a safe file in ``folder``."""
        _check_key(key)
        # surrogatepass: a key that is not Unicode text still hashes (and to its own name); valid
        # text encodes as plain UTF-8, so files saved by earlier versions keep their names.
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        return self._folder / f"{digest[:32]}.safetensors"

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._sessions))


def _check_key(key: object) -> None:
    if not isinstance(key, str) or not key:
        raise InvalidParamsError(f"A session key is a non-empty str, got {_shown(key)}.")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class BetweenTurns:
    """Work the pool's sessions hand over as their turns end (preparing the next compaction), run one
    at a time, in order, on a thread started when there is some (and ended, its MLX streams cleared,
    when there is no more)."""

    def __init__(self) -> None:
        self._work: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._running = False

    def submit(self, work: Callable[[], None]) -> None:
        with self._cond:
            self._work.append(work)
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="chatkit-pool-prepare", daemon=False).start()

    def wait(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._running, timeout)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if not self._work:
                        break
                    work = self._work.popleft()
                try:
                    work()
                except Exception:  # a preparation is only a saving: the next turn compacts by itself
                    pass
        finally:
            mx.clear_streams()  # MLX wants a thread's streams destroyed before the thread ends
            with self._cond:
                self._running = False
                self._cond.notify_all()
                if self._work:  # handed over after the loop looked: run it too
                    self._running = True
                    threading.Thread(target=self._run, name="chatkit-pool-prepare", daemon=False).start()


def _bytes(session: ChatSession) -> int:
    info = session.cache_info()
    return info.nbytes + info.checkpoint_bytes


__all__ = ["SessionPool"]
