"""``Conversation``: a session's messages and the KV cache that holds their tokens, changed together."""

from __future__ import annotations

from collections.abc import Sequence

from .cache.state import CacheState
from .messages import ChatMessage, Role


class Conversation:
    """The messages so far (without the instructions) and the cache state whose ledger names the
    tokens it holds. Messages change only through :meth:`record` / :meth:`rewind` / :meth:`clear`,
    each of which settles the cache in the same call, so the two cannot drift apart."""

    def __init__(self, messages: Sequence[ChatMessage], cache: CacheState) -> None:
        self._messages = tuple(messages)
        self.cache = cache

    @property
    def messages(self) -> tuple[ChatMessage, ...]:
        return self._messages

    def record(self, messages: Sequence[ChatMessage], fed: Sequence[int]) -> None:
        """A turn fed ``fed`` into the cache on top of its ledger and the conversation is now ``messages``."""
        self.cache.record(fed)
        self._messages = tuple(messages)

    def keep_cache(self, fed: Sequence[int]) -> None:
        """A turn that fed ``fed`` failed or was closed before a reply: the messages stay, the cache
        keeps what it provably holds."""
        if fed:
            self.cache.record(fed)

    def rewind(self, messages: Sequence[ChatMessage], ids: Sequence[int]) -> None:
        """The conversation is now the shorter ``messages``, whose rendering is ``ids``: rewind the cache
        to the longest prefix of ``ids`` it can come back to (or drop it)."""
        self._messages = tuple(messages)
        self.cache.rewind(ids)

    def clear(self) -> None:
        """No messages, no cache."""
        self._messages = ()
        self.cache.reset()

    def copy(self) -> Conversation:
        """An independent copy (for a fork): the cache layers share memory until one side writes."""
        return Conversation(self._messages, self.cache.copy())

    def ends_with_exchange(self) -> bool:
        """Whether the last two messages are a prompt and the assistant's reply to it."""
        m = self._messages
        return len(m) >= 2 and m[-1].role is Role.ASSISTANT and m[-2].role is not Role.ASSISTANT


__all__ = ["Conversation"]
