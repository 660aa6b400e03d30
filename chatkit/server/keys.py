"""The index keys of a conversation: hashes of what a request says came before (instructions, tools,
messages), one per prefix, so the server finds the pooled session that holds it; and the server's
conversations, one record each (``Conversation``), found by those keys (``ConversationIndex``)."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..messages import ChatMessage

Tools = Sequence[Mapping[str, Any]] | None


def prefix_keys(instructions: str | None, history: Sequence[ChatMessage], tools: Tools = None,
                as_sent: Mapping[str, str] | None = None, adapter: str | None = None) -> list[str]:
    """The index keys of a conversation's prefixes: ``keys[k]`` hashes the instructions, the tools
    and the first ``k`` messages (a hash chain, so all of them cost one pass). The tools are part of
    the root: the same messages with other tools render another prompt, so another conversation.
    ``as_sent``: a message's JSON as the session holds it -> as the client sent it (a guided prompt
    holds its schema's description; the client re-sends it without). ``adapter``: the name of the
    conversation's adapter, part of the root too (the same messages over another adapter are another
    conversation, whose cache must not be reused)."""
    if adapter:
        root = json.dumps([instructions, list(tools or ()), {"adapter": adapter}], sort_keys=True)
    else:
        root = json.dumps(instructions) if not tools else json.dumps([instructions, list(tools)], sort_keys=True)
    digest = hashlib.sha256(root.encode("utf-8")).hexdigest()
    keys = [digest]
    for m in history:
        text = message_json(m)
        data = digest + (as_sent.get(text, text) if as_sent else text)
        digest = hashlib.sha256(data.encode("utf-8")).hexdigest()
        keys.append(digest)
    return keys


def message_json(message: ChatMessage) -> str:
    """``message`` as canonical JSON (what its keys hash). A client re-sends the whole conversation
    each turn, so the JSON of the last ``JSON_MEMO`` messages without images is remembered (by the
    message's value, a hash away): a request then pays for its new messages only."""
    if message.images:  # not kept alive for this
        return _to_json(message)
    try:
        return _remembered_json(message)
    except TypeError:  # a message holding an unhashable value (a tool call's arguments): not remembered
        return _to_json(message)


def _to_json(message: ChatMessage) -> str:
    return json.dumps(message.to_dict(), ensure_ascii=False, sort_keys=True)


JSON_MEMO = 2048
_remembered_json = functools.lru_cache(maxsize=JSON_MEMO)(_to_json)


@dataclass
class Conversation:
    """What the server knows of one pooled conversation (the session itself is the pool's)."""

    chain: tuple[str, ...] = ()  # the keys of its prefixes (``prefix_keys``), the last its whole conversation's
    tools: tuple[Mapping[str, Any], ...] | None = None  # the client's tools, when it has some
    adapter: str | None = None  # its adapter's name, when it has one
    leased: bool = False  # a turn is open on it (its stream, or a copy's that will replace it)
    dormant: tuple[str | None, tuple[ChatMessage, ...]] | None = None  # saved by an earlier run, not rebuilt yet
    settling: asyncio.Future[Any] | None = None  # the blocking end of its last turn, on a worker thread


class ConversationIndex(dict[str, Conversation]):
    """The server's conversations by pool key, one record each, found by their keys (used on the event loop)."""

    def __init__(self) -> None:
        super().__init__()
        self._whole: dict[str, str] = {}  # a conversation's key -> its pool key
        self._prefixes: dict[str, str] = {}  # a prefix's key -> a pool key whose conversation starts so

    def find(self, key: str) -> str | None:
        """The pool key of the conversation whose key is ``key``."""
        return self._whole.get(key)

    def remember(self, conv: str, chain: Sequence[str], tools: Tools, adapter: str | None = None) -> Conversation:
        """Index ``conv`` (its record made if new) under its conversation's key (``chain[-1]``) and its prefixes'."""
        self._unindex(conv)
        record = self.setdefault(conv, Conversation())
        record.chain, self._whole[chain[-1]] = tuple(chain), conv
        for k in chain[1:]:  # prefixes with at least one message (instructions alone are cheap to prefill)
            self._prefixes[k] = conv
        if tools:
            record.tools = tuple(tools)
        if adapter:
            record.adapter = adapter
        return record

    def forget(self, conv: str) -> None:
        self._unindex(conv)
        self.pop(conv, None)

    def sharing(self, chain: Sequence[str]) -> Iterator[tuple[str, int]]:
        """Conversations that share a prefix (at least one message) with ``chain``, the longest first,
        each with the number of messages they share."""
        for n in range(len(chain) - 1, 0, -1):
            conv = self._prefixes.get(chain[n])
            if conv is not None:
                yield conv, n

    def _unindex(self, conv: str) -> None:
        chain = self[conv].chain if conv in self else ()
        if chain and self._whole.get(chain[-1]) == conv:
            del self._whole[chain[-1]]
        for k in chain:
            if self._prefixes.get(k) == conv:
                del self._prefixes[k]


__all__ = ["Conversation", "ConversationIndex", "Tools", "message_json", "prefix_keys"]
