"""The server's memory: conversations as pooled chat sessions, found by what a request says came before,
kept on disk with ``--store`` (the responses that chain by ``previous_response_id``: ``response_store.py``).

A request names a conversation by content: its instructions, its tools and the messages before the
new ones. ``SessionIndex`` indexes every pooled session by a hash of exactly that (its instructions,
tools and history), so a client that re-sends the whole conversation lands on the session that holds
it and pays only for the new message (or the results of the tools the last reply called: the client
runs them, each session is built with ``tool_execution="manual"``). After each turn the session is indexed
under its new history. Every session has the server's context policy: a conversation that outgrows the
window goes on (its history whole, so it is still found by what the client re-sends).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx

from ..decode.batch import BatchEngine
from ..decode.speculative import SpeculativeConfig
from ..errors import ChatKitError, ContextWindowExceededError, SessionBusyError
from ..messages import ChatMessage, Role
from ..model.loaded import LoadedModel
from ..params import GenerateParams
from ..session import saved
from ..session.aio import AsyncResponseStream
from ..session.context import ContextPolicy, exchange_starts
from ..session.pool import SessionPool
from ..session.session import ChatSession

log = logging.getLogger("chatkit.server")
T = TypeVar("T")
MANIFEST = "conversations.json"


Tools = Sequence[Mapping[str, Any]] | None
AS_SENT_LIMIT = 4096  # guided prompts remembered as clients send them (older ones: their turns prefill again)


def prefix_keys(instructions: str | None, history: Sequence[ChatMessage], tools: Tools = None,
                as_sent: Mapping[str, str] | None = None) -> list[str]:
    """The index keys of a conversation's prefixes: ``keys[k]`` hashes the instructions, the tools
    and the first ``k`` messages (a hash chain, so all of them cost one pass). The tools are part of
    the root: the same messages with other tools render another prompt, so another conversation.
    ``as_sent``: a message's JSON as the session holds it -> as the client sent it (a guided prompt
    holds its schema's description; the client re-sends it without)."""
    root = json.dumps(instructions) if not tools else json.dumps([instructions, list(tools)], sort_keys=True)
    digest = hashlib.sha256(root.encode("utf-8")).hexdigest()
    keys = [digest]
    for m in history:
        text = _json(m)
        data = digest + (as_sent.get(text, text) if as_sent else text)
        digest = hashlib.sha256(data.encode("utf-8")).hexdigest()
        keys.append(digest)
    return keys


def _json(message: ChatMessage) -> str:
    return json.dumps(message.to_dict(), ensure_ascii=False, sort_keys=True)


def conversation_key(instructions: str | None, history: Sequence[ChatMessage], tools: Tools = None) -> str:
    """The index key of a conversation: a hash of its instructions, tools and messages."""
    return prefix_keys(instructions, history, tools)[-1]


@dataclass
class Lease:
    """A turn in progress on a session: ``conv`` is its pool key (``None`` for a throwaway session);
    ``replaces``: the session is a copy that takes the pooled one's place once its turn commits."""

    session: ChatSession
    stream: AsyncResponseStream
    conv: str | None
    base: int  # messages the session held when the turn started
    replaces: bool = False
    asked: ChatMessage | None = None  # the prompt as the client sent it, when the session holds it changed

    def reply(self) -> ChatMessage | None:
        """The assistant message the turn committed (``None`` before it committed, or if it never did)."""
        history = self.session.history
        if len(history) > self.base + 1 and history[-1].role is Role.ASSISTANT:
            return history[-1]
        return None

    def compaction(self) -> dict[str, int] | None:
        """What the context policy did at this turn, once it ended: ``None``, or (it compacted) how many
        messages of the conversation the model no longer sees, the prompt tokens it dropped, and the
        new summary's tokens."""
        stats = self.stream.stats
        if stats is None or not stats.compacted:
            return None
        return {"dropped_messages": len(self.session.dropped_messages), "dropped_tokens": stats.dropped_tokens,
                "summary_tokens": stats.summary_tokens}


class SessionIndex:
    """Pooled sessions over one model, indexed by content (see the module docstring).

    Blocking work (building sessions, restoring and saving caches) runs on one worker thread of its
    own, so the event loop never waits on MLX and that thread's MLX streams are cleared at the end.
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
    ) -> None:
        self._lm = lm
        self._policy = context_policy if context_policy is not None else ContextPolicy()
        self._engine = engine
        self._defaults = defaults or GenerateParams()
        self._speculative = speculative
        self._persist = persist
        self._folder = Path(folder)
        self.pool = SessionPool(lm, folder=self._folder / "caches", max_cache_bytes=max_cache_bytes, engine=engine)
        self._max = max_conversations
        self._index: dict[str, str] = {}  # conversation_key -> pool key
        self._key_of: dict[str, str] = {}  # pool key -> its conversation_key
        self._prefixes: dict[str, str] = {}  # a prefix's key -> a pool key whose conversation starts so
        self._chain_of: dict[str, list[str]] = {}  # pool key -> its prefix keys
        self._tools: dict[str, tuple[Mapping[str, Any], ...]] = {}  # pool key -> its tools, when it has some
        self._dormant: dict[str, tuple[str | None, tuple[ChatMessage, ...]]] = {}  # saved by an earlier run
        self._leased: set[str] = set()
        self._as_sent: dict[str, str] = {}  # guided prompts: as the sessions hold them -> as clients send them
        self._lock = asyncio.Lock()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="chatkit-server")
        if persist:
            self._load_manifest()

    # -- a turn ---------------------------------------------------------------------------------
    async def start(self, instructions: str | None, history: Sequence[ChatMessage], added: Sequence[ChatMessage],
                    params: GenerateParams, *, tools: Tools = None, keep: bool = True,
                    schema: dict[str, Any] | None = None, strict_tools: bool = False) -> Lease:
        """Open a turn answering ``added`` (a message, or the tool results answering the last reply's
        calls: all but the last join the history first) after ``instructions`` + ``tools`` + ``history``:
        on the pooled session that holds exactly that conversation, else on a new one. ``keep=False``:
        on a throwaway copy that is not pooled. ``SessionBusyError`` if that conversation is generating
        now; a refused turn changes no conversation."""
        tools = tuple(tools) if tools else None
        async with self._lock:
            chain = prefix_keys(instructions, history, tools)
            conv = self._index.get(chain[-1])
            if conv is not None and not history and self._busy(conv):
                conv = None  # a new conversation: independent of another one that starts the same way
            replaces = created = False
            if conv is not None:
                session, conv, replaces = await self._continue(conv, added, keep)
            else:
                session, conv = await self._begin(instructions, history, added, tools, chain, keep)
                created = conv is not None
            try:
                if tools or added[-1].role is Role.TOOL:
                    await self._run(self._check_fits, session, added[-1])
                session.generate_params = params
                extra: dict[str, Any] = {"output": schema} if schema is not None else {}
                if strict_tools:
                    extra["strict_tools"] = True
                base = len(session.history)
                stream = await self._run(lambda: session.astream_respond(added[-1], **extra))
            except BaseException:
                if created and conv is not None:
                    self._forget(conv)  # created for this request, which was refused
                raise
            if conv is not None:
                self._leased.add(conv)
            return Lease(session, stream, conv, base, replaces, asked=added[-1] if schema is not None else None)

    async def _continue(self, conv: str, added: Sequence[ChatMessage],
                        keep: bool) -> tuple[ChatSession, str | None, bool]:
        """The pooled session ``conv`` for a turn answering ``added``: (session, its pool key or ``None``
        for a throwaway copy, whether it is a copy that replaces the pooled one once its turn commits)."""
        if self._busy(conv):
            raise SessionBusyError(
                "This conversation is already generating a reply: wait for it to finish "
                "(or stop that request) before sending the next message."
            )
        session = await self._run(self._session, conv)
        pooled: str | None = conv
        replaces = False
        if not keep or len(added) > 1:
            # The tool results before the last join the history before the turn: on a copy, which
            # replaces the pooled session only once the turn commits (a refused turn changes nothing).
            session, replaces = await self._run(session.fork), keep
            pooled = conv if keep else None
        for message in added[:-1]:
            await self._run(session.respond, message)  # answers a call; another one waits: no reply
        return session, pooled, replaces

    async def _begin(self, instructions: str | None, history: Sequence[ChatMessage], added: Sequence[ChatMessage],
                     tools: Tools, chain: list[str], keep: bool) -> tuple[ChatSession, str | None]:
        """A new session holding the conversation before the last of ``added``, seeded with the cache of
        the pooled conversation that shares the longest prefix with it; pooled (its key returned) with ``keep``."""
        source = self._longest_prefix(chain)
        held = (*history, *added[:-1])
        session = await self._run(self._build, instructions, held, tools)
        if source is not None:
            await self._run(self._seed, session, source)
        if not keep:
            return session, None
        conv = f"conv_{uuid.uuid4().hex}"
        await self._run(self.pool.add, conv, session)
        self._remember(conv, prefix_keys(instructions, held, tools), tools)
        return session, conv

    async def finish(self, lease: Lease) -> None:
        """After the lease's stream is closed (its turn committed or aborted): index the conversation
        under its new history and keep the caches under the budget."""
        async with self._lock:
            conv = lease.conv
            if conv is None:
                return
            self._leased.discard(conv)
            if conv not in self.pool:
                return
            if lease.replaces:
                if lease.reply() is None:
                    return  # the copy never got its reply: the pooled conversation stays as it was
                await self._run(self.pool.add, conv, lease.session)
            session = lease.session
            if lease.asked is not None and len(session.history) > lease.base:  # re-sent without the description
                self._as_sent[_json(session.history[lease.base])] = _json(lease.asked)
                while len(self._as_sent) > AS_SENT_LIMIT:
                    del self._as_sent[next(iter(self._as_sent))]  # the oldest
            self._remember(conv, prefix_keys(session.instructions, session.history, self._tools.get(conv),
                                             self._as_sent), self._tools.get(conv))
            await self._run(self.pool.enforce_budget)
            self._trim()

    # -- persistence ----------------------------------------------------------------------------
    async def close(self) -> None:
        """Save every conversation's cache (with ``persist``) and stop the worker thread."""
        async with self._lock:
            try:
                if self._persist:
                    await self._run(self._save_all)
            finally:
                await self._run(mx.clear_streams)
                self._io.shutdown(wait=True)

    def _save_all(self) -> None:
        kept = list(self._dormant)
        for conv in self.pool:
            session = self.pool.get(conv)
            if session is not None and not self.pool.evicted(conv) and not session.busy \
                    and session.cache_info().tokens:
                try:
                    session.save_cache(self.pool.path(conv))
                except ChatKitError as exc:
                    log.warning("could not save conversation %s: %s", conv, exc)
                    continue
            if self.pool.path(conv).exists():
                kept.append(conv)
        tools = {conv: list(self._tools[conv]) for conv in kept if conv in self._tools}
        tmp = self._folder / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps({"conversations": kept, "tools": tools}))
        os.replace(tmp, self._folder / MANIFEST)

    def _load_manifest(self) -> None:
        try:
            manifest = json.loads((self._folder / MANIFEST).read_text())
            convs, tools = manifest["conversations"], dict(manifest.get("tools") or {})
        except FileNotFoundError:
            return
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring a damaged %s: %s", MANIFEST, exc)
            return
        for conv in convs:
            try:
                conversation = saved.read(self.pool.path(conv))
            except ChatKitError as exc:
                log.warning("conversation %s cannot be restored (%s): it starts over", conv, exc)
                continue
            conv_tools = tuple(tools[conv]) if tools.get(conv) else None
            instructions, history = conversation.instructions, conversation.messages
            self._remember(conv, prefix_keys(instructions, history, conv_tools), conv_tools)
            self._dormant[conv] = (instructions, history)

    # -- internals (on the worker thread) ---------------------------------------------------------
    def _session(self, conv: str) -> ChatSession:
        """The pooled session ``conv``; one saved by an earlier run is rebuilt and its cache restored."""
        dormant = self._dormant.pop(conv, None)
        if dormant is None:
            try:
                return self.pool.session(conv)  # restores its cache if the pool evicted it
            except ChatKitError as exc:  # an unreadable evicted cache: the next turn prefills again
                log.warning("conversation %s: cache not restored (%s)", conv, exc)
                return self.pool.session(conv)
        tools, path = self._tools.get(conv), self.pool.path(conv)
        try:  # the file's conversation: its history, and what the context policy showed of it (its summary)
            session = self._build(*dormant, tools, restore=path)
        except ChatKitError:  # e.g. a draft model (its cache is not saved): the transcript, then the cache
            session = self._build(*dormant, tools)
            try:
                session.restore_cache(path)
            except ChatKitError as exc:  # the transcript is the truth: the first turn prefills it again
                log.warning("conversation %s: cache not restored (%s)", conv, exc)
        return self.pool.add(conv, session)

    def _build(self, instructions: str | None, history: Sequence[ChatMessage], tools: Tools,
               restore: Path | None = None) -> ChatSession:
        """A session over ``instructions`` + ``history``, or (``restore``) the conversation saved there."""
        builder = ChatSession.builder(self._lm).generate_params(self._defaults.copy()).engine(self._engine)
        builder = builder.context_policy(self._policy)
        builder = builder.cache(restore) if restore is not None else builder.instructions(instructions).history(history)
        if tools:  # the client runs the tools: a reply that calls them ends the turn
            builder = builder.tools([dict(t) for t in tools], tool_execution="manual")
        return (builder.speculative(self._speculative) if self._speculative is not None else builder).build()

    def _check_fits(self, session: ChatSession, message: ChatMessage) -> None:
        """A session with tools opens its turn only as its stream is read, after the response's status
        went out: check the prompt fits the context window now, so that it is a 413 (the turn checks again).
        With a policy that compacts, what must fit is the instructions and the exchange ``message`` is part of."""
        limit = self._lm.context_length
        if limit is None:
            return
        if session.context_policy.mode != "error":
            history = session.history
            starts = exchange_starts([*history, message])
            current = history[starts[-1]:] if starts and starts[-1] < len(history) else []
            session = self._build(session.instructions, current, session.tools)  # renders only: no cache work
        needed = len(self._lm.tokenizer.encode(session.render(message, role=message.role), add_special_tokens=False))
        if needed >= limit:
            raise ContextWindowExceededError(
                f"The prompt is {needed} tokens but the model's context window is {limit}: shorten the conversation "
                "(or the tool results).", prompt_tokens=needed, context_length=limit)

    def _remember(self, conv: str, chain: list[str], tools: Tools) -> None:
        """Index ``conv`` under its conversation's key (``chain[-1]``) and its prefixes' keys."""
        self._unindex(conv)
        self._index[chain[-1]], self._key_of[conv], self._chain_of[conv] = conv, chain[-1], chain
        for k in chain[1:]:  # prefixes with at least one message (instructions alone are cheap to prefill)
            self._prefixes[k] = conv
        if tools:
            self._tools[conv] = tuple(tools)

    def _unindex(self, conv: str) -> None:
        key = self._key_of.pop(conv, None)
        if key is not None and self._index.get(key) == conv:
            del self._index[key]
        for k in self._chain_of.pop(conv, ()):
            if self._prefixes.get(k) == conv:
                del self._prefixes[k]

    def _longest_prefix(self, chain: list[str]) -> str | None:
        """An idle conversation sharing the longest prefix (at least one message) with ``chain``."""
        for k in reversed(chain[1:]):
            conv = self._prefixes.get(k)
            if conv is not None and not self._busy(conv):
                return conv
        return None

    def _busy(self, conv: str) -> bool:
        """Whether ``conv`` has a turn open (its stream, or a copy's turn that will replace it)."""
        session = self.pool.get(conv)
        return conv in self._leased or (session is not None and session.busy)

    def _seed(self, session: ChatSession, source: str) -> None:
        """Give a new session the KV cache of ``source``, a conversation that starts as its own does:
        its first turn reuses the common prefix (the planner trims the rest) instead of prefilling it
        all. The public way across sessions is a cache file: the pool's, or a handoff file written now."""
        path = self.pool.path(source)
        pooled = self.pool.get(source)
        handoff = pooled is not None and source not in self._dormant and not self.pool.evicted(source)
        if handoff:
            path = self._folder / "handoff.safetensors"
        try:
            if pooled is not None and handoff:
                pooled.save_cache(path)
            session.restore_cache(path)
        except ChatKitError as exc:  # e.g. no cache yet: the first turn prefills everything
            log.info("conversation not seeded from %s: %s", source, exc)
        finally:
            if handoff:
                path.unlink(missing_ok=True)

    def _forget(self, conv: str) -> None:
        self._unindex(conv)
        self._dormant.pop(conv, None)
        self._tools.pop(conv, None)
        self.pool.remove(conv)

    def _trim(self) -> None:
        """Forget the least recently used idle conversations beyond ``max_conversations``."""
        for conv in list(self.pool):  # least recently used first
            if len(self.pool) <= self._max:
                break
            if not self._busy(conv):
                self._forget(conv)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)


__all__ = ["SessionIndex", "Lease", "conversation_key"]
