"""The server's memory: conversations as pooled chat sessions, found by what a request says came before,
and stored responses that chain by ``previous_response_id``; both kept on disk with ``--store``.

A request names a conversation by content: its instructions and the messages before the new one.
``Conversations`` indexes every pooled session by a hash of exactly that (its instructions and its
history), so a client that re-sends the whole conversation lands on the session that holds it and
pays only for the new message. After each turn the session is indexed under its new history.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx

from ..aio import AsyncResponseStream
from ..builder import ChatSessionBuilder
from ..cache.store import inspect as inspect_cache
from ..errors import ChatKitError, SessionBusyError
from ..loading import LoadedModel
from ..messages import ChatMessage
from ..params import GenerateParams
from ..pool import SessionPool
from ..session import ChatSession
from ..speculative import SpeculativeConfig
from .errors import UnknownResponseError

log = logging.getLogger("chatkit.server")
T = TypeVar("T")
MANIFEST = "conversations.json"


def prefix_keys(instructions: str | None, history: Sequence[ChatMessage]) -> list[str]:
    """The index keys of a conversation's prefixes: ``keys[k]`` hashes the instructions and the first
    ``k`` messages (a hash chain, so all of them cost one pass)."""
    digest = hashlib.sha256(json.dumps(instructions).encode("utf-8")).hexdigest()
    keys = [digest]
    for m in history:
        data = digest + json.dumps(m.to_dict(), ensure_ascii=False, sort_keys=True)
        digest = hashlib.sha256(data.encode("utf-8")).hexdigest()
        keys.append(digest)
    return keys


def conversation_key(instructions: str | None, history: Sequence[ChatMessage]) -> str:
    """The index key of a conversation: a hash of its instructions and messages."""
    return prefix_keys(instructions, history)[-1]


@dataclass
class Lease:
    """A turn in progress on a session: ``conv`` is its pool key (``None`` for a throwaway session)."""

    session: ChatSession
    stream: AsyncResponseStream
    conv: str | None


class Conversations:
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
    ) -> None:
        self._lm = lm
        self._defaults = defaults or GenerateParams()
        self._speculative = speculative
        self._persist = persist
        self._folder = Path(folder)
        self._pending: tuple[str | None, Sequence[ChatMessage]] = (None, ())  # what the next new session holds
        self.pool = SessionPool(lm, folder=self._folder / "caches", max_cache_bytes=max_cache_bytes,
                                configure=self._configure)
        self._max = max_conversations
        self._index: dict[str, str] = {}  # conversation_key -> pool key
        self._key_of: dict[str, str] = {}  # pool key -> its conversation_key
        self._prefixes: dict[str, str] = {}  # a prefix's key -> a pool key whose conversation starts so
        self._chain_of: dict[str, list[str]] = {}  # pool key -> its prefix keys
        self._dormant: dict[str, tuple[str | None, tuple[ChatMessage, ...]]] = {}  # saved by an earlier run
        self._leased: set[str] = set()
        self._sessions: dict[str, ChatSession] = {}  # pool key -> its session (the pool's own object)
        self._lock = asyncio.Lock()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="chatkit-server")
        if persist:
            self._load_manifest()

    # -- a turn ---------------------------------------------------------------------------------
    async def start(self, instructions: str | None, history: Sequence[ChatMessage], message: ChatMessage,
                    params: GenerateParams, *, keep: bool = True, schema: dict[str, Any] | None = None) -> Lease:
        """Open a turn answering ``message`` after ``instructions`` + ``history``: on the pooled session
        that holds exactly that conversation, else on a new one. ``keep=False``: on a throwaway copy
        that is not pooled. ``SessionBusyError`` if that conversation is generating now."""
        async with self._lock:
            chain = prefix_keys(instructions, history)
            key = chain[-1]
            conv = self._index.get(key)
            created = False
            if conv is not None and not history and self._sessions.get(conv, None) is not None \
                    and self._sessions[conv].busy:
                conv = None  # a new conversation: independent of another one that starts the same way
            if conv is not None:
                session = await self._run(self._session, conv)
                if session.busy:
                    raise SessionBusyError(
                        "This conversation is already generating a reply: wait for it to finish "
                        "(or stop that request) before sending the next message."
                    )
                if not keep:
                    session, conv = await self._run(session.fork), None
            else:
                source = self._longest_prefix(chain)
                if keep:
                    conv, created = f"conv_{uuid.uuid4().hex}", True
                    session = await self._run(self._create, conv, instructions, history)
                    self._index_conv(conv, chain)
                else:
                    session = await self._run(lambda: self._setup(ChatSession.builder(self._lm), instructions,
                                                                 history).build())
                if source is not None:
                    await self._run(self._seed, session, source)
            try:
                session.generate_params = params
                extra: dict[str, Any] = {"output": schema} if schema is not None else {}
                stream = await self._run(lambda: session.astream_respond(message, **extra))
            except BaseException:
                if created and conv is not None:
                    self._forget(conv)
                raise
            if conv is not None:
                self._leased.add(conv)
            return Lease(session, stream, conv)

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
            self._index_conv(conv, prefix_keys(lease.session.instructions, lease.session.history))
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
            session = self._sessions[conv]
            if not self.pool.evicted(conv) and not session.busy and session.cache_info().tokens:
                try:
                    session.save_cache(self.pool.path(conv))
                except ChatKitError as exc:
                    log.warning("could not save conversation %s: %s", conv, exc)
                    continue
            if self.pool.path(conv).exists():
                kept.append(conv)
        tmp = self._folder / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps({"conversations": kept}))
        os.replace(tmp, self._folder / MANIFEST)

    def _load_manifest(self) -> None:
        try:
            convs = json.loads((self._folder / MANIFEST).read_text())["conversations"]
        except FileNotFoundError:
            return
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring a damaged %s: %s", MANIFEST, exc)
            return
        for conv in convs:
            try:
                info = inspect_cache(self.pool.path(conv))
                history = tuple(ChatMessage.from_dict(m) for m in info.messages)
            except ChatKitError as exc:
                log.warning("conversation %s cannot be restored (%s): it starts over", conv, exc)
                continue
            self._index_conv(conv, prefix_keys(info.instructions, history))
            self._dormant[conv] = (info.instructions, history)

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
        session = self._create(conv, *dormant)
        try:
            session.restore_cache(self.pool.path(conv))
        except ChatKitError as exc:  # the transcript is the truth: the first turn prefills it again
            log.warning("conversation %s: cache not restored (%s)", conv, exc)
        return session

    def _create(self, conv: str, instructions: str | None, history: Sequence[ChatMessage]) -> ChatSession:
        # SessionPool builds its sessions through one `configure` callback: tell it what this one holds.
        self._pending = (instructions, tuple(history))
        try:
            session = self._sessions[conv] = self.pool.session(conv)
            return session
        finally:
            self._pending = (None, ())

    def _configure(self, builder: ChatSessionBuilder) -> ChatSessionBuilder:
        return self._setup(builder, *self._pending)

    def _setup(self, builder: ChatSessionBuilder, instructions: str | None,
               history: Sequence[ChatMessage]) -> ChatSessionBuilder:
        builder = builder.generate_params(self._defaults.copy()).instructions(instructions).history(history)
        return builder.speculative(self._speculative) if self._speculative is not None else builder

    def _index_conv(self, conv: str, chain: list[str]) -> None:
        """Index ``conv`` under its conversation's key (``chain[-1]``) and its prefixes' keys."""
        self._unindex(conv)
        self._index[chain[-1]], self._key_of[conv], self._chain_of[conv] = conv, chain[-1], chain
        for k in chain[1:]:  # prefixes with at least one message (instructions alone are cheap to prefill)
            self._prefixes[k] = conv

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
            if conv is not None and conv not in self._leased and not self._busy(conv):
                return conv
        return None

    def _busy(self, conv: str) -> bool:
        session = self._sessions.get(conv)
        return session is not None and session.busy

    def _seed(self, session: ChatSession, source: str) -> None:
        """Give a new session the KV cache of ``source``, a conversation that starts as its own does:
        its first turn reuses the common prefix (the planner trims the rest) instead of prefilling it
        all. The public way across sessions is a cache file: the pool's, or a handoff file written now."""
        path = self.pool.path(source)
        handoff = source not in self._dormant and not self.pool.evicted(source)
        if handoff:
            path = self._folder / "handoff.safetensors"
        try:
            if handoff:
                self._sessions[source].save_cache(path)
            session.restore_cache(path)
        except ChatKitError as exc:  # e.g. no cache yet: the first turn prefills everything
            log.info("conversation not seeded from %s: %s", source, exc)
        finally:
            if handoff:
                path.unlink(missing_ok=True)

    def _forget(self, conv: str) -> None:
        self._unindex(conv)
        self._dormant.pop(conv, None)
        self._sessions.pop(conv, None)
        self.pool.remove(conv)

    def _trim(self) -> None:
        """Forget the least recently used idle conversations beyond ``max_conversations``."""
        for conv in list(self.pool):  # least recently used first
            if len(self.pool) <= self._max:
                break
            if conv not in self._leased and not self._sessions[conv].busy:
                self._forget(conv)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)


class ResponseStore:
    """Responses by id, each with what it added to its conversation; one JSON file per response in
    ``folder`` (written atomically) when given, so chains outlive the server."""

    def __init__(self, folder: str | os.PathLike[str] | None) -> None:
        self._folder = Path(folder) if folder is not None else None
        self._records: dict[str, dict[str, Any]] = {}
        if self._folder is not None:
            self._folder.mkdir(parents=True, exist_ok=True)
            for path in self._folder.glob("resp_*.json"):
                try:
                    record = json.loads(path.read_text())
                    self._records[record["response"]["id"]] = record
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    log.warning("ignoring the unreadable stored response %s: %s", path.name, exc)

    def add(self, response: dict[str, Any], added: Sequence[ChatMessage], output: str) -> None:
        """Keep ``response`` (an OpenAI response object) with the messages it added and its reply."""
        record = {"response": response, "added": [m.to_dict() for m in added], "output": output}
        self._records[response["id"]] = record
        if self._folder is not None:
            path = self._folder / f"{response['id']}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, ensure_ascii=False))
            os.replace(tmp, path)

    def get(self, rid: str) -> dict[str, Any]:
        """The stored response object; ``UnknownResponseError`` if there is none with that id."""
        return self._record(rid)["response"]

    def transcript(self, rid: str) -> tuple[ChatMessage, ...]:
        """The conversation up to and including response ``rid``'s reply."""
        chain = []
        while rid is not None:
            record = self._record(rid)
            chain.append(record)
            rid = record["response"].get("previous_response_id")
            if len(chain) > len(self._records):
                raise UnknownResponseError("The stored responses form a loop: start a new conversation.")
        messages: list[ChatMessage] = []
        for record in reversed(chain):
            messages += [ChatMessage.from_dict(m) for m in record["added"]]
            messages.append(ChatMessage.assistant(record["output"]))
        return tuple(messages)

    def _record(self, rid: str) -> dict[str, Any]:
        record = self._records.get(rid)
        if record is None:
            raise UnknownResponseError(
                f"No stored response {rid!r}: it was never stored (store=false) or belongs to another server; "
                "send the conversation again without previous_response_id."
            )
        return record


__all__ = ["Conversations", "Lease", "ResponseStore", "conversation_key"]
