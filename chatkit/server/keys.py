"""The index keys of a conversation: hashes of what a request says came before (instructions, tools,
messages), one per prefix, so the server finds the pooled session that holds it."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
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


__all__ = ["Tools", "message_json", "prefix_keys"]
