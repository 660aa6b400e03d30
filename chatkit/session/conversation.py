"""``Conversation``: a session's messages, what the model sees of them (a ``Window``) and the KV cache
that holds their tokens, changed together."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..cache.planner import common_prefix_length
from ..cache.state import CacheState
from ..errors import ChatKitError, NothingToRegenerateError, NothingToUndoError
from ..messages import ChatMessage, Role, ToolCall
from .context import Window

IdsOf = Callable[[Window, Sequence[ChatMessage]], list[int]]  # a window over messages -> their rendering


class Conversation:
    """The messages so far (without the instructions), the window the model sees them through, and the
    cache state whose ledger names the tokens it holds. Messages change only through :meth:`record` /
    :meth:`rewind` / :meth:`clear`, each of which settles the window and the cache in the same call, so
    they cannot drift apart. A compaction keeps the window it replaced, so undoing the turn that
    compacted shows the model the dropped exchanges again."""

    def __init__(self, messages: Sequence[ChatMessage], cache: CacheState, window: Window = Window(),
                 earlier: Sequence[tuple[int, Window]] = ()) -> None:
        self._messages = tuple(messages)
        self.cache = cache
        self.window = window
        self.earlier = tuple(earlier)  # (history length when a turn compacted, the window before it)

    @property
    def messages(self) -> tuple[ChatMessage, ...]:
        return self._messages

    def record(self, messages: Sequence[ChatMessage], fed: Sequence[int], window: Window | None = None) -> None:
        """A turn fed ``fed`` into the cache on top of its ledger and the conversation is now ``messages``,
        seen through ``window`` (a compaction of the turn that answered the history's first
        ``len(self.messages)`` messages and on; ``None``: unchanged)."""
        self.cache.record(fed)
        if window is not None and window != self.window:
            self.earlier = (*self.earlier, (len(self._messages), self.window))
            self.window = window
        self._messages = tuple(messages)

    def keep_cache(self, fed: Sequence[int]) -> None:
        """A turn that fed ``fed`` failed or was closed before a reply: the messages stay, the cache
        keeps what it provably holds."""
        if fed:
            self.cache.record(fed, failed=True)

    def rewind(self, messages: Sequence[ChatMessage], ids_of: IdsOf) -> None:
        """The conversation is now the shorter ``messages``: the windows of compactions made after it are
        undone, and the cache rewinds to the longest prefix of the rendering (``ids_of``) it can come back
        to (or is dropped)."""
        self._messages = tuple(messages)
        undone = self.window
        while self.earlier and self.earlier[-1][0] >= len(messages):
            self.window = self.earlier[-1][1]
            self.earlier = self.earlier[:-1]
        try:
            ids = ids_of(self.window, self._messages)
            if undone != self.window and self.cache.ledger.shifted:
                # A shifted cache holds the kept tokens where the dropped ones were: keep only what comes
                # before the first of them (the same ids there would be keys computed in another context).
                ids = ids[: common_prefix_length(ids, ids_of(undone, self._messages))]
        except ChatKitError:
            ids = []  # cannot render what is left: the cache rewinds as far as it can
        self.cache.rewind(ids)

    def clear(self) -> None:
        """No messages, no cache."""
        self._messages = ()
        self.window, self.earlier = Window(), ()
        self.cache.reset()

    def copy(self) -> Conversation:
        """An independent copy (for a fork): the cache layers share memory until one side writes."""
        return Conversation(self._messages, self.cache.copy(), self.window, self.earlier)

    def with_cache(self, cache: CacheState) -> Conversation:
        """The same conversation over another cache (restored, or rebuilt with new options)."""
        return Conversation(self._messages, cache, self.window, self.earlier)

    def ends_with_exchange(self) -> bool:
        """Whether the last two messages are a prompt and the assistant's reply to it."""
        m = self._messages
        return len(m) >= 2 and m[-1].role is Role.ASSISTANT and m[-2].role is not Role.ASSISTANT

    def ends_with_tool_round(self) -> bool:
        """Whether the history ends with tool results answering the assistant's calls before them: a
        tool loop that stopped (closed, or failed) after its tools ran, before the model answered."""
        m = self._messages
        call = len(m) - 1
        while call > 0 and m[call].role is Role.TOOL:
            call -= 1
        return call < len(m) - 1 and call > 0 and m[call].role is Role.ASSISTANT and bool(m[call].tool_calls)

    def prompt_of(self, message: ChatMessage | None, regenerate: bool) -> tuple[tuple[ChatMessage, ...], ChatMessage]:
        """(the messages before a turn's prompt, the prompt): ``message`` after the history, or (``None``)
        the history's last message (a tool round), or (``regenerate``) the last prompt again;
        ``NothingToRegenerateError`` when there is nothing to answer."""
        base = self._messages
        if message is not None:
            return base, message
        if not regenerate:
            if not base or base[-1].role is Role.ASSISTANT:
                raise NothingToRegenerateError("There is no message to answer: send a prompt.")
            return base[:-1], base[-1]
        if not self.ends_with_exchange():
            raise NothingToRegenerateError("There is no reply to regenerate: the history does not end with a reply.")
        return base[:-2], base[-2]

    def undo(self, tool_rounds: bool, ids_of: IdsOf) -> list[ChatMessage]:
        """Drop the last exchange (with ``tool_rounds``, over its tool rounds, also of a loop that stopped
        before its answer) and rewind (see :meth:`rewind`); returns the dropped messages.
        ``NothingToUndoError`` when the history does not end with one."""
        if not (self.ends_with_exchange() or tool_rounds and self.ends_with_tool_round()):
            raise NothingToUndoError("There is no exchange to undo: the history does not end with a reply.")
        start = self.exchange_start(tool_rounds)
        dropped = list(self._messages[start:])
        self.rewind(self._messages[:start], ids_of)
        return dropped

    def exchange_start(self, tool_rounds: bool) -> int:
        """Where the last exchange starts: its prompt (call only if :meth:`ends_with_exchange`, or with
        ``tool_rounds`` if :meth:`ends_with_tool_round`). With ``tool_rounds`` (an automatic tool loop
        answered it) the exchange reaches back over its tool calls and their results to the prompt
        that started the loop."""
        m = self._messages
        start = len(m) - 2 if m[-1].role is Role.ASSISTANT else len(m) - 1
        while tool_rounds and m[start].role is Role.TOOL:
            call = start
            while call > 0 and m[call].role is Role.TOOL:
                call -= 1
            if call == 0 or m[call].role is not Role.ASSISTANT or not m[call].tool_calls:
                break  # tool results the app sent as a prompt, not a round of the loop
            start = call - 1
        return start


def pending_calls(history: Sequence[ChatMessage]) -> list[ToolCall]:
    """The calls of the last assistant message that no tool message after it answers yet."""
    answered: set[str] = set()
    for message in reversed(history):
        if message.role is Role.TOOL:
            if message.tool_call_id is not None:
                answered.add(message.tool_call_id)
            continue
        if message.role is Role.ASSISTANT:
            return [c for c in message.tool_calls if c.id not in answered]
        return []
    return []


__all__ = ["Conversation", "pending_calls"]
