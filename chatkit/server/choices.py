"""OpenAI's ``n`` on chat completions: more than one choice for one prompt.

Choice 0 is the request's turn on its pooled session. Each further choice is a fork of that session
once choice 0 committed (``ChatSession.fork``: a copy of the cache, sharing its memory) that answers the
same prompt again (``stream_regenerate``): its cache holds the prompt already, so the prompt is
prefilled once for all choices. With a ``seed``, choice ``i`` samples with ``seed + i`` (so the choices
differ, and each is reproducible: the reply a session seeded so would give); with ``temperature`` 0 all
choices are the same. Only choice 0 is pooled: a client that goes on with another choice re-sends it,
and that conversation starts from the pooled one's cached prefix (the prompt), as any other would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from ..messages import ChatMessage, Role
from ..session.aio import AsyncResponseStream
from ..session.session import ChatSession
from ..session.streams import ReplyStream
from .errors import BadRequestError
from .lease import Lease, turn_params

Run = Callable[..., Awaitable[Any]]  # ``SessionIndex.run``

MAX_CHOICES = 16


def read_n(body: Mapping[str, Any]) -> int:
    """``n``: how many choices (1 to ``MAX_CHOICES``; absent or null: 1)."""
    n = body.get("n")
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise BadRequestError(f"n must be an integer from 1 to {MAX_CHOICES}.", param="n")
    return n


class Choice:
    """One further choice: its fork and the stream of its turn."""

    def __init__(self, index: int, session: ChatSession, stream: AsyncResponseStream) -> None:
        self.index, self.session, self.stream = index, session, stream

    def reply(self) -> ChatMessage:
        """The reply the fork committed (or what streamed, if it did not)."""
        last = self.session.history[-1] if self.session.history else None
        if last is not None and last.role is Role.ASSISTANT and self.stream.stats is not None:
            return last
        return ChatMessage.assistant(self.stream.text)


async def more_choices(lease: Lease, n: int, run: Run) -> AsyncIterator[Choice]:
    """Choices 1 to ``n - 1`` (see the module docstring), one at a time: each is opened once the one
    before was read (the caller closes its stream); none once choice 0 did not commit. ``run``: the
    server's one worker thread for blocking work (``SessionIndex.run``): the fork and its turn's
    opening are one hop to it."""
    params = lease.params if lease.params is not None else lease.session.generate_params
    for index in range(1, n):
        if lease.reply() is None:
            return

        def fork(index: int = index) -> tuple[ChatSession, ReplyStream]:
            session = lease.session.fork()  # not pooled: it regenerates with its own settings, the choice's
            session.generate_params = turn_params(params, index)
            return session, session.stream_regenerate()
        session, stream = await run(fork)
        yield Choice(index, session, AsyncResponseStream(stream))


__all__ = ["MAX_CHOICES", "Choice", "more_choices", "read_n"]
