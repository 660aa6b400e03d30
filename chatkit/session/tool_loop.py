"""The tool loop: the model calls tools, chatkit calls them, the results go back, the model goes on.

Each round is one ordinary turn (``chatkit.session.turn.Turn`` through a ``ResponseStream``) that commits
the reply as it completes; the tool messages answering its calls (``tool_call_id`` and ``name`` set,
in the order of the calls) enter the history before the next round starts, so each round prefills
only the tool results and the template's glue. The loop knows the session only through the two
callables it is given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import replace
from typing import Any

from ..errors import MissingDependencyError, ToolLoopLimitError
from ..messages import ChatMessage, ToolCall
from ..params import LogitsProcessor
from ..text.reply import PieceKind
from ..tools.options import DEFAULT_MAX_TOOL_ROUNDS
from ..tools.schema import Tool, call_tool, stopped
from .results import StreamChunk, TurnStats
from .streams import ReplyStream, ResponseStream

OpenRound = Callable[[ChatMessage | None], ResponseStream]  # a turn answering the message (None: the history's last)
Append = Callable[[Sequence[ChatMessage]], None]  # tool results enter the history
CLOSE_WAIT = 5.0  # seconds close() from another thread waits for the loop to leave its tools and end

def _no_chunks() -> Generator[StreamChunk, None, None]:
    yield from ()


class ToolLoopStream(ReplyStream):
    """What ``session.stream_respond`` returns when the session has tools (or the prompt is a tool
    result): a reply that may take several rounds, streamed: the chunks of every round, with a chunk of kind
    ``"tool_result"`` per tool result between rounds (``chunk.tool_call`` is the call it answers,
    ``chunk.token`` is -1). A round that ends by calling tools ends with ``finish_reason="tool_calls"``.

    Iterate it, or use it as a context manager, as a ``ResponseStream``; ``close()`` stops the current
    round (which commits what it produced) and starts no other. ``ToolLoopLimitError`` when the model
    still calls tools after ``max_rounds`` rounds of results.

    Each tool call runs on a thread of its own and fails after ``timeout`` seconds (``None``: no
    limit). ``close()`` from another thread while a tool runs does not wait for it: the calls of that
    round are answered (the unfinished ones as stopped), an async tool is cancelled, a sync one is left
    running on its thread (its result dropped), and the loop ends.
    """

    def __init__(
        self,
        open_round: OpenRound,
        append: Append,
        tools: Sequence[Tool],
        first: ChatMessage | None,
        *,
        execute: bool = True,
        max_rounds: int = DEFAULT_MAX_TOOL_ROUNDS,
        raise_errors: bool = False,
        timeout: float | None = None,
        generate: bool = True,
        on_end: Callable[[], None] | None = None,
        images: bool = False,
    ) -> None:
        """``on_end`` runs once when the loop is over (answered, failed or closed): the session holds
        the conversation for the loop until then, also between rounds, while a tool runs. With ``images``
        (a vision-language model) the images a tool returns (``ToolOutput``) are its message's, else notes."""
        self._open, self._append, self._tools = open_round, append, list(tools)
        self._on_end, self._images = on_end, images
        self._execute, self._max_rounds, self._raise, self._timeout = execute, max_rounds, raise_errors, timeout
        self._in_tools = False  # the loop's thread is waiting for tools (close() from another thread waits for it to end)
        self._ended = threading.Event()
        self._round: ResponseStream | None = None
        self._calls: list[ToolCall] = []
        self._results: list[ChatMessage] = []
        self._rounds = 0
        self._stopped = threading.Event()
        self._done = not generate
        self._chunks = self._run(first) if generate else _no_chunks()

    # -- what a ResponseStream offers -------------------------------------------------------------
    @property
    def text(self) -> str:
        """The answer of the last round (the final answer once the loop ended)."""
        return self._round.text if self._round is not None else ""

    @property
    def reasoning(self) -> str:
        """The reasoning of the last round."""
        return self._round.reasoning if self._round is not None else ""

    @property
    def tool_calls(self) -> list[ToolCall]:
        """Every tool call of every round so far, in order."""
        return list(self._calls) + (self._round.tool_calls if self._round is not None else [])

    @property
    def tool_results(self) -> list[ChatMessage]:
        """The tool messages chatkit added to the history, in order."""
        return list(self._results)

    @property
    def rounds(self) -> int:
        """How many replies the model has given (or is giving) in this loop."""
        return self._rounds

    @property
    def tokens(self) -> list[int]:
        """The tokens of the last round."""
        return self._round.tokens if self._round is not None else []

    @property
    def finish_reason(self) -> str | None:
        """As a ``ResponseStream``'s, but ``"tool_calls"`` when the last round ended by calling tools."""
        finish = self._round.finish_reason if self._round is not None else None
        return "tool_calls" if finish == "stop" and self._round is not None and self._round.tool_calls else finish

    @property
    def stats(self) -> TurnStats | None:
        """``TurnStats`` of the last round (each round's stats are also ``session.last_stats`` as it ends)."""
        return self._round.stats if self._round is not None else None

    @property
    def closed(self) -> bool:
        """Whether the loop is over (answered, failed or closed)."""
        return self._done

    def __next__(self) -> StreamChunk:
        if self._done:  # closed from another thread while this one ran the loop: it ends here
            try:
                self._chunks.close()
            except ValueError:  # still running on that thread: its own next step ends the loop
                raise StopIteration from None
            self._end()
            raise StopIteration
        try:
            return next(self._chunks)
        except BaseException:
            self._done = True
            self._end()
            raise

    def close(self) -> None:
        """Stop: the current round commits what it produced; no further round starts. A tool running
        meanwhile is not waited for (see the class docstring)."""
        self._stopped.set()
        if self._round is not None:
            self._round.close()
        self._done = True
        try:
            self._chunks.close()
        except ValueError:  # running on another thread: it sees the stop flag, and its next step ends the loop
            if self._in_tools:  # it leaves its tool at once, answers the calls and ends: then the session is free
                self._ended.wait(CLOSE_WAIT)
            return
        self._end()

    def discard(self) -> None:
        """Stop, committing nothing when the loop is in its first round (its prompt and reply stay out of
        the history); after a round of tool results, as :meth:`close`."""
        if self._rounds == 1 and self._round is not None and not self._results:
            self._round.discard()
        self.close()

    @property
    def discarded(self) -> bool:
        """Whether :meth:`discard` dropped the loop's only round."""
        return self._rounds == 1 and self._round is not None and self._round.discarded

    def interrupt(self) -> None:
        """Tell the loop to stop, from any thread, doing no work here: a running tool is left (an async
        one cancelled), and the thread running the loop ends it (an async stream's worker)."""
        self._stopped.set()

    def _end(self) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()
        self._ended.set()

    # -- the loop -----------------------------------------------------------------------------------
    def _run(self, first: ChatMessage | None) -> Generator[StreamChunk, None, None]:
        message: ChatMessage | None = first
        while not self._stopped.is_set():
            if self._round is not None:
                self._calls.extend(self._round.tool_calls)
            self._round = stream = self._open(message)
            self._rounds += 1
            for chunk in stream:
                if chunk.finish_reason == "stop" and stream.tool_calls:
                    chunk = replace(chunk, finish_reason="tool_calls")
                yield chunk
            calls = stream.tool_calls
            if not calls or not self._execute or stream.finish_reason != "stop" or self._stopped.is_set():
                return
            if self._rounds > self._max_rounds:
                raise ToolLoopLimitError(
                    f"The model still called tools after {self._max_rounds} rounds of results "
                    f"({', '.join(c.name for c in calls)}); its calls are in the history, unanswered. Raise "
                    "max_tool_rounds on the builder, or answer them with respond(result, role=Role.TOOL, tool_call_id=...)."
                )
            results = self._call(calls)
            self._append(results)
            self._results.extend(results)
            if self._stopped.is_set():
                return
            for call, result in zip(calls, results, strict=True):
                yield StreamChunk(result.content, -1, kind=PieceKind.TOOL_RESULT, tool_call=call)
            message = None


    def _call(self, calls: Sequence[ToolCall]) -> list[ChatMessage]:
        """The results of ``calls``, in order; once the loop is stopped the rest are answered as not run."""
        self._in_tools = True
        try:
            return [
                stopped(call) if self._stopped.is_set()
                else call_tool(self._tools, call, raise_errors=self._raise, timeout=self._timeout, stop=self._stopped,
                                 images=self._images)
                for call in calls
            ]
        finally:
            self._in_tools = False


def strict_grammar(tokenizer: Any, tools: Sequence[Tool]) -> Any:
    """The strict tool-call grammar of ``tools`` for ``tokenizer``: ``InvalidOutputSpecError`` for a
    format or a schema that cannot be constrained, ``MissingDependencyError`` without the guided extra."""
    try:
        from ..guided.call_grammar import tool_call_grammar  # the guided extra
    except ImportError as e:
        raise MissingDependencyError(f"strict_tools needs the guided extra: pip install 'chatkit[guided]' ({e}).") from e
    return tool_call_grammar(tokenizer, [t.schema for t in tools])


class StrictCalls:
    """A session's strict tool calls: the grammar of its current tools, compiled once per tool set,
    and the constraint that holds a reply's calls to it."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._compiled: tuple[Sequence[Tool], Any] | None = None

    def grammar(self, tools: Sequence[Tool]) -> Any:
        if self._compiled is None or self._compiled[0] is not tools:
            self._compiled = (tools, strict_grammar(self._tokenizer, tools))
        return self._compiled[1]

    def constraint(self, tools: Sequence[Tool], stop: Sequence[str]) -> LogitsProcessor:
        from ..guided.call_grammar import ToolCallConstraint  # the guided extra (checked when the grammar was built)

        return ToolCallConstraint(self.grammar(tools), self._tokenizer, stop=stop)


__all__ = ["StrictCalls", "ToolLoopStream", "strict_grammar"]
