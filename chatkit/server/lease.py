"""A turn in progress on one of the server's pooled sessions, and what it reports when it ends."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from ..messages import ChatMessage, Role
from ..params import GenerateParams
from ..session.aio import AsyncResponseStream
from ..session.session import ChatSession


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
    model: str = ""  # the served model's id as replies show it (``<id>:<adapter>`` with an adapter)
    settled: bool = False  # closed, re-indexed and its slot freed (``ServerState.settled``)
    delivered: bool = False  # some of the reply reached the client (``app._Settling``): a stop then commits it
    params: GenerateParams | None = None  # the turn's own sampling (``turn_params``)

    def keep_when_stopped(self) -> None:
        """A turn stopped before its end (the client went away) commits what it produced only once some
        of the reply reached the client; before that it is discarded: the conversation (and a response
        chain) stays as it was, as if the request had never come."""
        ref = weakref.ref(self)  # the stream's worker must not keep the lease (and its stream) alive
        self.stream.discard_unless(lambda: (lease := ref()) is not None and lease.delivered)

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


def turn_params(params: GenerateParams, choice: int = 0) -> GenerateParams:
    """The one place the server decides a turn's sampling: ``params`` (the request's, with its tool
    choice's bias and constraint; ``ServerState.open_turn``), for chat completions' choice ``choice``:
    with a ``seed``, choice ``i`` samples with ``seed + i``. A turn takes it as its own (``params=``): a
    pooled session's settings never change."""
    if choice and params.seed is not None:
        return params.copy(seed=(params.seed + choice) % 2**64)
    return params


__all__ = ["Lease", "turn_params"]
