"""The server's conversations: pooled chat sessions, found by what a request says came before; with
``--store`` their caches are written behind each turn (``write_behind``) and listed in a manifest, so
they outlive the process, also a crash (the stored responses: ``response_store``).

A request names a conversation by content: its instructions, its tools and the messages before the
new ones. ``SessionIndex`` indexes every pooled session by a hash of exactly that (its instructions,
tools and history), so a client that re-sends the whole conversation lands on the session that holds
it and pays only for the new message (or the results of the tools the last reply called: the client
runs them, each session is built with ``tool_execution="manual"``). After each turn the session is indexed
under its new history. Every session has the server's context policy: a conversation that outgrows the
window goes on (its history whole, so it is still found by what the client re-sends). A session with
an adapter (``adapters``, by name) is another conversation than the same messages without it, or with
another: its name is part of the keys, so a request is never answered on a session of another adapter.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx

from ..cache import atomic
from ..cache.prompt import PromptCache
from ..decode.batch import BatchEngine
from ..decode.speculative import SpeculativeConfig
from ..errors import ChatKitError, NoCacheAvailableError, SessionBusyError
from ..messages import ChatMessage, Role
from ..model.adapters import Adapter
from ..model.loaded import LoadedModel
from ..params import GenerateParams
from ..session import saved
from ..session.aio import AsyncResponseStream
from ..session.context import ContextPolicy
from ..session.pool import SessionPool
from ..session.session import ChatSession
from . import manifest, trace
from .keys import ConversationIndex, Tools, message_json, prefix_keys
from .lease import Lease, turn_params
from .write_behind import Job, WriteBehind

log = logging.getLogger("chatkit.server")
T = TypeVar("T")

AS_SENT_LIMIT = 4096  # guided prompts remembered as clients send them (older ones: their turns prefill again)
COUNTERS = 8  # sessions kept to count tokens with, one per instructions and tools


class SessionIndex:
    """Pooled sessions over one model, indexed by content (see the module docstring).

    Blocking work (building and forking sessions, restoring and saving caches) runs on one worker
    thread of its own (:meth:`run`), in the order it was asked for, so the event loop never waits on
    MLX and that thread's MLX streams are cleared at the end. A new conversation that starts as a
    pooled one does is a fork of it, in memory (no file); the prompt cache (``prompt_cache``, on by
    default) holds the KV blocks of every prefix the server prefilled, for every other conversation.
    """

    def __init__(
        self,
        lm: LoadedModel,
        *,
        folder: str | os.PathLike[str],
        max_cache_bytes: int,
        max_conversations: int = 256,
        defaults: GenerateParams | None = None,
        speculative: SpeculativeConfig | None = None,
        persist: bool = False,
        engine: BatchEngine | None = None,
        context_policy: ContextPolicy | None = None,
        adapters: Mapping[str, Adapter] | None = None,
        prompt_cache: PromptCache | None = None,  # shared by its sessions (the server state resolves "default")
        max_kv_bytes: int | None = None,  # each conversation's KV budget (its window: the tokens that fit)
    ) -> None:
        self._lm, self._prompt_cache, self._max_kv_bytes = lm, prompt_cache, max_kv_bytes
        self._policy = context_policy if context_policy is not None else ContextPolicy()
        self._engine = engine
        self._defaults, self._speculative, self._persist = defaults or GenerateParams(), speculative, persist
        self._folder = Path(folder)
        self.pool = SessionPool(lm, folder=self._folder / "caches", max_cache_bytes=max_cache_bytes, engine=engine)
        self._max = max_conversations
        self._convs = ConversationIndex()  # pool key -> its record, found by its conversation's keys
        self._adapters = dict(adapters or {})
        self._as_sent: dict[str, str] = {}  # guided prompts: as the sessions hold them -> as clients send them
        self._counters: dict[str, ChatSession] = {}  # instructions and tools (their key) -> a session that renders them
        self._lock = asyncio.Lock()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="chatkit-server")
        self._behind = WriteBehind(self._write_job, self._submit) if persist else None
        if persist:
            atomic.remove_stale_temps(self._folder)  # a cache or list a killed process was writing
            (self._folder / (manifest.MANIFEST + ".tmp")).unlink(missing_ok=True)  # ... as older versions wrote it
            self._load_manifest()

    # -- a turn ---------------------------------------------------------------------------------
    async def start(self, instructions: str | None, history: Sequence[ChatMessage], added: Sequence[ChatMessage],
                    params: GenerateParams, *, tools: Tools = None, keep: bool = True,
                    schema: dict[str, Any] | None = None, strict_tools: bool = False,
                    adapter: str | None = None) -> Lease:
        """Open a turn answering ``added`` (a message, or the tool results answering the last reply's
        calls: all but the last join the history first) after ``instructions`` + ``tools`` + ``history``:
        on the pooled session that holds exactly that conversation, else on a new one. ``keep=False``:
        on a throwaway copy that is not pooled; ``adapter``: the name of the adapter it runs with.
        ``SessionBusyError`` if that conversation is generating now; a refused turn changes no conversation.
        The turn starts generating at once (its prefill runs while the response starts); finding the
        session and opening the turn are one hop to the worker thread."""
        tools = tuple(tools) if tools else None
        extra: dict[str, Any] = {"output": schema} if schema is not None else {}
        if strict_tools:
            extra["strict_tools"] = True
        async with self._lock:
            chain = prefix_keys(instructions, history, tools, adapter=adapter)
            conv = self._convs.find(chain[-1])
            if conv is not None:
                await self._settled(conv)  # the blocking end of its last turn (``finish``) is done
            if conv is not None and not history and self._busy(conv):
                conv = None  # a new conversation: independent of another one that starts the same way
            replaces = created = False
            if conv is not None:
                await self._written(conv)
                find, conv, replaces = self._continue(conv, added, keep)
            else:
                find, conv = await self._begin(instructions, history, added, tools, chain, keep, adapter)
                created = conv is not None

            def open_turn() -> tuple[ChatSession, int, AsyncResponseStream]:
                session = find()
                trace.stamp("session")
                if tools or added[-1].role is Role.TOOL:  # its turn opens only as its stream is read: a 413 now
                    session.check_fits(added[-1], params=params)
                turn = session.astream_respond(added[-1], params=turn_params(params), **extra)
                return session, len(session.history), turn

            try:
                session, base, stream = await self.run(open_turn)
            except BaseException:
                if created and conv is not None:
                    self._forget(conv)  # created for this request, which was refused
                raise
            trace.stamp("opened")
            if created and conv is not None:
                chain = prefix_keys(instructions, (*history, *added[:-1]), tools, adapter=adapter)
                self._convs.remember(conv, chain, tools, adapter)
            stream.start()
            if conv is not None:
                self._convs[conv].leased = True
            return Lease(session, stream, conv, base, replaces, added[-1] if schema is not None else None, params=params)

    def _continue(self, conv: str, added: Sequence[ChatMessage],
                  keep: bool) -> tuple[Callable[[], ChatSession], str | None, bool]:
        """How to get the pooled session ``conv`` for a turn answering ``added`` (on the worker thread),
        its pool key (``None`` for a throwaway copy) and whether it is a copy that replaces the pooled
        session once its turn commits."""
        if self._busy(conv):
            raise SessionBusyError(
                "This conversation is already generating a reply: wait for it to finish "
                "(or stop that request) before sending the next message."
            )
        # The tool results before the last join the history before the turn: on a copy, which
        # replaces the pooled session only once the turn commits (a refused turn changes nothing).
        copy = not keep or len(added) > 1

        def find() -> ChatSession:
            session = self._session(conv)
            if copy:
                session = session.fork()
            for message in added[:-1]:
                session.respond(message)  # answers a call; another one waits: no reply
            return session
        return find, conv if keep else None, copy and keep

    async def _begin(self, instructions: str | None, history: Sequence[ChatMessage], added: Sequence[ChatMessage],
                     tools: Tools, chain: list[str], keep: bool,
                     adapter: str | None) -> tuple[Callable[[], ChatSession], str | None]:
        """How to build (on the worker thread) a new session holding the conversation before the last of
        ``added``, pooled with ``keep``; and its pool key (the caller indexes it once it is built). A
        conversation it shares a prefix with seeds it: in memory a fork of it (``_branch``), from its file
        when its cache is there (saved by an earlier run, or evicted); else the prompt cache serves what it
        holds of the prefix at the first turn."""
        source, shared = next(((c, n) for c, n in self._convs.sharing(chain) if not self._busy(c)), (None, 0))
        if source is not None:
            await self._written(source)
        conv = f"conv_{uuid.uuid4().hex}" if keep else None

        def find() -> ChatSession:
            session = self._branch(source, history, shared) if source is not None else None
            if session is not None:
                for message in added[:-1]:
                    session.respond(message)  # answers a call; another one waits: no reply
            else:
                session = self._build(instructions, (*history, *added[:-1]), tools, adapter)
                if source is not None:
                    self._seed(session, source)
            return self.pool.add(conv, session) if conv is not None else session
        return find, conv

    async def count_tokens(self, instructions: str | None, history: Sequence[ChatMessage],
                           added: Sequence[ChatMessage], params: GenerateParams, *, tools: Tools = None) -> int:
        """The prompt a turn answering ``added`` would have, rendered by a session kept per instructions and tools."""
        tools = tuple(tools) if tools else None
        key = prefix_keys(instructions, (), tools)[0]

        def count() -> int:  # on the worker thread, the only one that touches ``_counters``
            session = self._counters.pop(key, None) or self._build(instructions, (), tools)
            self._counters[key] = session  # the most recently used last
            while len(self._counters) > COUNTERS:
                del self._counters[next(iter(self._counters))]
            session.generate_params = params  # (its template switches shape the instructions' render too)
            return session.token_count + session.count_tokens([*history, *added])
        return await self.run(count)

    async def finish(self, lease: Lease) -> None:
        """After the lease's stream is closed (its turn committed or aborted): index the conversation
        under its new history; the blocking rest (a copy taking the pooled session's place, the caches
        kept under the budget) is handed to the worker thread, not waited for: the next turn on the
        conversation waits for it (``_settled``), the worker's other jobs queue behind it."""
        async with self._lock:
            conv = lease.conv
            record = self._convs.get(conv) if conv is not None else None
            if conv is None or record is None:
                return
            record.leased = False
            if conv not in self.pool or (lease.replaces and lease.reply() is None):
                return  # gone, or the copy never got its reply: the pooled conversation stays as it was
            session = lease.session
            if lease.asked is not None and len(session.history) > lease.base:  # re-sent without the description
                self._as_sent[message_json(session.history[lease.base])] = message_json(lease.asked)
                while len(self._as_sent) > AS_SENT_LIMIT:
                    del self._as_sent[next(iter(self._as_sent))]  # the oldest
            chain = prefix_keys(session.instructions, session.history, record.tools, self._as_sent, record.adapter)
            self._convs.remember(conv, chain, record.tools, record.adapter)
            replacing = session if lease.replaces else None

            def settle() -> None:
                if replacing is not None:
                    self.pool.add(conv, replacing)
                self.pool.enforce_budget()
            record.settling = self._submit(settle)
            record.settling.add_done_callback(lambda done: self._after_settling(conv, done))
            self._trim()

    def _after_settling(self, conv: str, done: asyncio.Future[Any]) -> None:  # on the loop
        if not done.cancelled() and done.exception() is not None:  # its keys name a history the pool may not hold
            log.warning("conversation %s: the end of its turn failed (%s); it is forgotten", conv, done.exception())
            self._forget(conv)
        elif self._behind is not None and conv in self.pool and conv in self._convs:
            self._behind.touch(conv)  # written behind the turn, after the reply went out

    def footprint(self) -> dict[str, int]:
        """Cheap figures for ``/metrics``: the conversations pooled, the bytes of their KV caches in
        memory (this process's share over a sharded model) and of the cache files on disk."""
        memory = 0
        for conv in self.pool:
            session = self.pool.get(conv)
            if session is not None and not self.pool.evicted(conv):
                info = session.cache_info()
                memory += info.nbytes + info.checkpoint_bytes
        try:
            disk = sum(e.stat().st_size for e in os.scandir(self._folder / "caches") if e.is_file())
        except OSError:
            disk = 0
        return {"sessions": len(self.pool), "memory_bytes": memory, "disk_bytes": disk}

    # -- persistence ----------------------------------------------------------------------------
    async def close(self) -> None:
        """Save every conversation's cache (with ``persist``) and stop the worker thread."""
        async with self._lock:
            try:
                await self.run(lambda: None)  # the ends of the last turns (``finish``) ran, and touched their writes
                if self._behind is not None:
                    await self._behind.close()
                if self._persist:
                    await self.run(self._save_all)
            finally:
                await self.run(mx.clear_streams)
                self._io.shutdown(wait=True)

    def _save_all(self) -> None:
        for conv in self.pool:
            try:
                self._save(conv, self.pool.get(conv))
            except ChatKitError as exc:
                log.warning("could not save conversation %s: %s", conv, exc)
        self._write_manifest(*self._manifest())

    def _write_job(self, conv: str) -> Job | None:
        """(On the loop, when ``conv``'s write is due) the write of its cache and of the manifest, or
        ``None``: it is gone, or a turn holds it (whose end writes it again)."""
        if conv not in self.pool or conv not in self._convs or self._busy(conv) or self._behind is None:
            return None
        if self._lock.locked():  # a turn is opening or closing, maybe on conv: a moment later
            self._behind.touch(conv)
            return None
        session, manifest = self.pool.get(conv), self._manifest()

        def job() -> None:
            try:
                self._save(conv, session)
            except (SessionBusyError, NoCacheAvailableError):
                pass  # the pool is evicting it right now: its file is being written, or was
            self._write_manifest(*manifest)
        return job

    def _save(self, conv: str, session: ChatSession | None) -> None:
        """Write ``conv``'s cache unless the pool holds it on disk already (or it has none)."""
        if session is not None and not self.pool.evicted(conv) and not session.busy and session.cache_info().tokens:
            session.save_cache(self.pool.path(conv), images=True)

    def _manifest(self) -> tuple[list[str], dict[str, list[Any]], dict[str, str]]:
        """(On the loop) the conversations to list, those saved by an earlier run first, their tools and adapters."""
        records = self._convs
        dormant = [conv for conv, record in records.items() if record.dormant is not None]
        convs = [*dormant, *(conv for conv in self.pool if conv in records and records[conv].dormant is None)]
        return (convs, {conv: list(tools) for conv in convs if (tools := records[conv].tools)},
                {conv: adapter for conv in convs if (adapter := records[conv].adapter)})

    def _write_manifest(self, convs: list[str], tools: dict[str, list[Any]], adapters: dict[str, str]) -> None:
        """The list of conversations whose cache file exists, with their tools and adapters, written atomically."""
        kept = [conv for conv in convs if self.pool.path(conv).exists()]
        manifest.write(self._folder, kept, tools, adapters)

    def _load_manifest(self) -> None:
        convs, tools, adapters = manifest.read(self._folder)
        for conv in convs:
            if adapters.get(conv) is not None and adapters[conv] not in self._adapters:
                log.warning("conversation %s: this server has no adapter %r now; it is not restored", conv, adapters[conv])
                continue
            try:
                conversation = saved.read(self.pool.path(conv))
            except ChatKitError as exc:
                log.warning("conversation %s cannot be restored (%s): it starts over", conv, exc)
                continue
            conv_tools = tuple(tools[conv]) if tools.get(conv) else None
            instructions, history = conversation.instructions, conversation.messages
            name = adapters.get(conv)
            self._convs.remember(conv, prefix_keys(instructions, history, conv_tools, adapter=name), conv_tools, name)
            self._convs[conv].dormant = (instructions, history)

    # -- internals (on the worker thread) ---------------------------------------------------------
    def _session(self, conv: str) -> ChatSession:
        """The pooled session ``conv``; one saved by an earlier run is rebuilt and its cache restored."""
        record = self._convs[conv]
        dormant, record.dormant = record.dormant, None
        if dormant is None:
            try:
                return self.pool.session(conv)  # restores its cache if the pool evicted it
            except ChatKitError as exc:  # an unreadable evicted cache: the next turn prefills again
                log.warning("conversation %s: cache not restored (%s)", conv, exc)
                return self.pool.session(conv)
        tools, adapter, path = record.tools, record.adapter, self.pool.path(conv)
        try:  # the file's conversation: its history, and what the context policy showed of it (its summary)
            session = self._build(*dormant, tools, adapter, restore=path)
        except ChatKitError:  # e.g. a draft model (its cache is not saved): the transcript, then the cache
            session = self._build(*dormant, tools, adapter)
            try:
                session.restore_cache(path)
            except ChatKitError as exc:  # the transcript is the truth: the first turn prefills it again
                log.warning("conversation %s: cache not restored (%s)", conv, exc)
        return self.pool.add(conv, session)

    def _build(self, instructions: str | None, history: Sequence[ChatMessage], tools: Tools,
               adapter: str | None = None, restore: Path | None = None) -> ChatSession:
        """A session over ``instructions`` + ``history`` with the adapter named ``adapter``, or
        (``restore``) the conversation saved there."""
        builder = ChatSession.builder(self._lm).generate_params(self._defaults.copy()).engine(self._engine)
        builder = builder.prompt_cache(self._prompt_cache)
        builder = builder.context_policy(self._policy).adapter(self._adapters[adapter] if adapter else None)
        builder = builder.max_kv_bytes(self._max_kv_bytes) if self._max_kv_bytes is not None else builder
        builder = builder.cache(restore) if restore is not None else builder.instructions(instructions).history(history)
        if tools:  # the client runs the tools: a reply that calls them ends the turn
            builder = builder.tools([dict(t) for t in tools], tool_execution="manual")
        return (builder.speculative(self._speculative) if self._speculative is not None else builder).build()

    def _branch(self, source: str, history: Sequence[ChatMessage], shared: int) -> ChatSession | None:
        """(A new conversation whose history is ``history``, the first ``shared`` messages ``source``'s) a fork
        of the pooled ``source`` in memory: taken back (``undo``) when ``history`` ends an exchange of it, else
        holding ``history`` over a copy of the cache (its first turn reuses their common prefix); ``None``
        when ``source``'s cache is not in memory or it compacted."""
        pooled, record = self.pool.get(source), self._convs.get(source)
        if pooled is None or record is None or record.dormant or self.pool.evicted(source) or pooled.dropped_messages:
            return None
        if shared < len(history):
            return pooled.fork(history=history)
        session = pooled.fork()
        try:
            while len(session.history) > len(history):
                session.undo()
        except ChatKitError:  # the history does not end with an exchange there
            return pooled.fork(history=history)
        return session if len(session.history) == len(history) else pooled.fork(history=history)

    def _seed(self, session: ChatSession, source: str) -> None:
        """Give a new session the KV cache of ``source`` (sharing a prefix with it) when it is in a file (saved
        by an earlier run, or evicted): its first turn reuses the common prefix (the planner trims the rest)."""
        record = self._convs.get(source)
        if not (record is not None and record.dormant is not None or self.pool.evicted(source)):
            return
        try:
            session.restore_cache(self.pool.path(source))
        except ChatKitError as exc:  # e.g. no cache yet: the first turn prefills everything
            log.info("conversation not seeded from %s: %s", source, exc)

    def _busy(self, conv: str) -> bool:
        """Whether ``conv`` has a turn open (its stream, or a copy's turn that will replace it), or its
        last turn's end is still running on the worker thread."""
        record, session = self._convs.get(conv), self.pool.get(conv)
        settling = record is not None and record.settling is not None and not record.settling.done()
        return (record is not None and record.leased) or settling or (session is not None and session.busy)

    def _forget(self, conv: str) -> None:  # its record, its index keys, its pooled session and cache file
        if self._behind is not None:
            self._behind.cancel(conv)
        self._convs.forget(conv)
        self.pool.remove(conv)

    def _trim(self) -> None:
        """Forget the least recently used idle conversations beyond ``max_conversations``."""
        for conv in list(self.pool):  # least recently used first
            if len(self.pool) <= self._max:
                break
            if not self._busy(conv) and not (self._behind is not None and self._behind.writing(conv)):
                self._forget(conv)

    async def _written(self, conv: str) -> None:
        """Until ``conv``'s cache, being written behind its last turn, is written (a turn must not meet it)."""
        if self._behind is not None:
            await self._behind.wait(conv)

    async def _settled(self, conv: str) -> None:
        """Until the end of ``conv``'s last turn (``finish``) ran on the worker thread."""
        if (record := self._convs.get(conv)) is not None and record.settling is not None:
            await asyncio.wait([record.settling])

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the index's worker thread (the one that does all of the server's blocking
        MLX work, in the order it is asked for), in this request's context (its trace, ``trace.py``)."""
        return await self._submit(fn, *args)

    def _submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """``fn(*args)`` queued on the worker thread (see :meth:`run`); its future, not awaited."""
        return asyncio.get_running_loop().run_in_executor(self._io, contextvars.copy_context().run, fn, *args)


__all__ = ["SessionIndex"]
