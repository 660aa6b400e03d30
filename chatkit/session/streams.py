"""Reply streams: one surface (:class:`ReplyStream`) for every kind of reply.

``ResponseStream`` is one turn streamed, committing exactly once; ``GuidedStream`` is a turn whose reply
is a value; the tool loop's stream (``tool_loop.ToolLoopStream``) and the async streams (``aio``) offer
the same surface.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import mlx.core as mx

from ..decode import DraftCount, TokenEvent
from ..errors import ChatKitError
from ..messages import ChatMessage, ToolCall
from ..text.reply import Piece, PieceKind, Segmenter
from .results import StreamChunk, TurnResult, TurnStats


class TurnSteps(Protocol):
    """What a stream drives: a prepared turn (``chatkit.session.turn.Turn``) and the plain data it streams with."""

    prompt_tokens: int
    max_tokens: int
    stop: Sequence[str]
    eos_token_ids: frozenset[int]
    drafts: DraftCount
    detokenizer: Any
    segmenter: Segmenter

    def start(self) -> tuple[int, Iterator[TokenEvent]]:
        """Plan and prefill; (tokens prefilled, the generated tokens)."""
        ...

    def commit(self, result: TurnResult) -> None: ...

    def abort(self, exc: BaseException | None, generated: Sequence[int] = ()) -> None:
        """Settle without a reply: ``exc`` is what failed (``None``: closed before the first chunk);
        ``generated``: the tokens it had produced (the cache may hold them)."""
        ...


class ReplyStream(ABC):
    """What every reply stream offers: iterate it for ``StreamChunk`` s, or use it as a context manager.

    ``text``, ``reasoning``, ``tool_calls`` and ``tokens`` grow as it streams; ``finish_reason`` and
    ``stats`` are set once it has ended; ``result()`` is the reply's result (the text, or a guided
    reply's value). Closing it (``close()``, leaving the ``with`` block, or dropping it) commits the
    turn as far as it went. ``rounds`` and ``tool_results`` tell what a tool loop did (one round and
    none for a plain reply).
    """

    @property
    @abstractmethod
    def text(self) -> str:
        """The answer so far (no reasoning, no tool calls); after the end, as committed."""

    @property
    @abstractmethod
    def reasoning(self) -> str:
        """The reasoning so far (``""`` if the model did not reason)."""

    @property
    @abstractmethod
    def tool_calls(self) -> list[ToolCall]:
        """The tool calls completed so far."""

    @property
    @abstractmethod
    def tokens(self) -> list[int]:
        """Token ids generated so far (end-of-turn token included)."""

    @property
    @abstractmethod
    def finish_reason(self) -> str | None:
        """Why the reply ended: ``"stop"``, ``"length"``, ``"cancelled"`` (or ``"tool_calls"`` in a loop)."""

    @property
    @abstractmethod
    def stats(self) -> TurnStats | None:
        """The turn's ``TurnStats`` once the stream is closed; ``None`` before."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """Whether the reply has ended (and its turn committed)."""

    @property
    def rounds(self) -> int:
        """How many replies the model has given (a tool loop gives one per round)."""
        return 1

    @property
    def tool_results(self) -> list[ChatMessage]:
        """The tool messages chatkit added to the history (a tool loop's results)."""
        return []

    def result(self) -> Any:
        """The reply's result once it has ended: its text (a guided reply: its value)."""
        return self.text

    @abstractmethod
    def __next__(self) -> StreamChunk: ...

    @abstractmethod
    def close(self) -> None:
        """Stop generating and commit what was produced. Safe to call more than once."""

    def discard(self) -> None:
        """Stop generating and commit nothing: the session stays as it was before the turn (a server
        whose client went away before any of the reply reached it). Once the turn committed (its reply
        ended), or after ``close()``, it does nothing."""
        self.close()

    @property
    def discarded(self) -> bool:
        """Whether the turn was discarded (:meth:`discard`): nothing of it entered the history."""
        return False

    def __iter__(self) -> ReplyStream:
        return self

    def __enter__(self) -> ReplyStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass  # never raise from the garbage collector


def drain(stream: ReplyStream) -> Any:
    """Run ``stream`` to its end and return its result (what ``respond`` returns)."""
    with stream:
        for _ in stream:
            pass
    return stream.result()


class ResponseStream(ReplyStream):
    """The reply of one turn, streamed. Iterate it for ``StreamChunk`` s; use it as a context manager.

    The turn commits exactly once: at the end of the reply, on ``close()``, on leaving the ``with``
    block, or when the stream is garbage-collected. What was produced so far (stop strings cut off)
    becomes the assistant's reply in the session's history. Closing before the first chunk leaves
    the session unchanged.
    """

    def __init__(self, turn: TurnSteps) -> None:
        self._turn = turn
        self._detok = turn.detokenizer
        self._eos = turn.eos_token_ids
        self._max_tokens = turn.max_tokens
        self._prompt_tokens = turn.prompt_tokens
        self._prefilled = 0
        # Reasoning / tool-call markers and stop strings, in one mlx-lm TextStateMachine.
        self._segments = turn.segmenter
        self._pending: list[StreamChunk] = []
        self._result: TurnResult | None = None  # further chunks of the last token (one per kind)
        self._detok_seen = 0  # characters of the detokenizer's text already passed on
        self._tokens: Iterator[TokenEvent] | None = None
        self._generated: list[int] = []
        self._finish: str | None = None
        self._stats: TurnStats | None = None
        self._done = False
        self._settled = False  # the session was told the outcome (commit or abort), exactly once
        self._discarded = False
        self._lock = threading.Lock()  # close() may come from the garbage collector or another thread
        self._t_start = self._t_first = 0.0
        self._drafts = turn.drafts  # filled by a speculative token source

    # -- public surface -----------------------------------------------------------------------
    @property
    def text(self) -> str:
        """The answer so far (no reasoning, no tool calls); after the end, as committed."""
        return self._result.text if self._result is not None else self._segments.text

    @property
    def reasoning(self) -> str:
        """The reasoning so far (``""`` if the model did not reason); after the end, as committed."""
        if self._result is not None:
            return self._result.reasoning or ""
        return self._segments.reasoning

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The tool calls completed so far."""
        return list(self._segments.tool_calls)

    @property
    def tokens(self) -> list[int]:
        """Token ids generated so far (end-of-turn token included)."""
        return list(self._generated)

    @property
    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"`` or ``"cancelled"`` once the reply has ended."""
        return self._finish

    @property
    def stats(self) -> TurnStats | None:
        """The turn's ``TurnStats`` once the stream is closed; ``None`` before."""
        return self._stats

    @property
    def closed(self) -> bool:
        """Whether the reply has ended (and its turn committed)."""
        return self._done

    def __next__(self) -> StreamChunk:
        with self._lock:
            if self._pending:
                return self._pending.pop(0)
            if self._done:
                raise StopIteration
            try:
                return self._next_chunk()
            except StopIteration:
                raise
            except BaseException as exc:
                self._abort(exc)
                raise

    def close(self) -> None:
        """Stop generating and commit what was produced. Safe to call more than once."""
        with self._lock:
            if self._done:
                return
            if self._tokens is None:
                self._abort(None)  # nothing was generated: the session stays as it was
            else:
                self._finish = self._finish or "cancelled"
                if self._segments.kind == PieceKind.TOOL_CALL:  # cut inside a call: kept as far as written, unread
                    self._take_pieces(final=True)
                self._commit()

    def discard(self) -> None:
        """Stop generating and settle the turn without a reply (as a turn that failed): the history is
        as before the turn, and the cache keeps only what it provably holds (the next turn trims it
        back). Does nothing once the turn has committed."""
        with self._lock:
            if not self._done:
                self._discarded = True
                self._abort(None)

    @property
    def discarded(self) -> bool:
        """Whether :meth:`discard` dropped the turn."""
        return self._discarded

    # -- internals ----------------------------------------------------------------------------
    def _next_chunk(self) -> StreamChunk:
        if self._tokens is None:
            mx.reset_peak_memory()
            self._t_start = time.perf_counter()
            self._prefilled, self._tokens = self._turn.start()
        event = next(self._tokens)
        token = event.id
        if not self._generated:
            self._t_first = time.perf_counter()
        self._generated.append(token)
        finish = None
        if token in self._eos:
            finish = "stop"
        else:
            self._detok.add_token(token)
            if len(self._generated) >= self._max_tokens:
                finish = "length"
        pieces = self._take_pieces(final=finish is not None)
        if self._segments.stopped:
            finish = "stop"
        chunks = [
            StreamChunk(p.text, token, finish if i == len(pieces) - 1 else None, event.from_draft, event.logprobs, p.kind,
                        p.tool_call)
            for i, p in enumerate(pieces)
        ]
        if finish is not None:
            self._finish = finish
            self._commit()
        self._pending.extend(chunks[1:])
        return chunks[0]

    def _take_pieces(self, final: bool) -> list[Piece]:
        """The text the detokenizer completed, cut into pieces of one kind each (at least one)."""
        if final:
            self._detok.finalize()
        full = self._detok.text
        new, self._detok_seen = full[self._detok_seen :], len(full)
        return self._segments.feed(new, final=final)

    def _stats_now(self) -> TurnStats:
        now = time.perf_counter()
        n = len(self._generated)
        prefill_time = (self._t_first - self._t_start) if n else 0.0
        decode_time = now - self._t_first if n else 0.0
        drafts = self._drafts
        return TurnStats(
            prompt_tokens=self._prompt_tokens,
            reused_tokens=self._prompt_tokens - self._prefilled,
            prefilled_tokens=self._prefilled,
            generation_tokens=n,
            prompt_tps=self._prefilled / prefill_time if prefill_time > 0 else 0.0,
            generation_tps=(n - 1) / decode_time if n > 1 and decode_time > 0 else 0.0,
            peak_memory_bytes=int(mx.get_peak_memory()),
            finish_reason=self._finish,
            draft_tokens_proposed=drafts.drafted,
            draft_tokens_accepted=drafts.accepted,
            draft_length=drafts.drafted / drafts.steps if drafts.steps else 0.0,
            plan=_plan_name(getattr(self._turn, "plan", None)),
            **_compaction(getattr(self._turn, "fit", None)),
        )

    def _close_source(self) -> None:
        """Close the token generator. Whatever that raises, the turn still settles: the cache's
        offsets say what it holds. (mlx-lm's generator holds an MLX stream context across its
        yields, and closing it from another thread than the one that ran it raises.)"""
        close = getattr(self._tokens, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                pass

    def _commit(self) -> None:
        self._done = True
        self._close_source()
        self._stats = self._stats_now()
        self._settled = True
        seg = self._segments
        text, reasoning = seg.reply()
        self._result = TurnResult(text, tuple(self._generated), self._stats, reasoning, tuple(seg.tool_calls))
        self._turn.commit(self._result)

    def _abort(self, exc: BaseException | None) -> None:
        self._done = True
        if self._settled:
            return  # the commit itself failed: the session has already settled the turn
        self._settled = True
        try:
            self._close_source()
        finally:
            self._turn.abort(exc, self._generated)


class ValueReader(Protocol):
    """What turns a guided reply's tokens into its value (``chatkit.guided.Constraint``)."""

    spec: Any

    def text_of(self, tokens: Sequence[int]) -> str: ...

    def finish(self, tokens: Sequence[int] | None = None) -> Any: ...


class GuidedStream(ReplyStream):
    """A :class:`ResponseStream` whose reply is a value (guided generation): ``partial`` while it
    streams, ``value`` (and ``result()``) once it has ended; the rest is the stream's."""

    def __init__(self, stream: ResponseStream, reader: ValueReader) -> None:
        self.stream = stream
        self.constraint = reader

    @property
    def partial(self) -> Any:
        """The latest partial value: for JSON the complete fields so far (``None`` before any)."""
        return self.constraint.spec.partial(self.constraint.text_of(self.stream.tokens))

    @property
    def value(self) -> Any:
        """The final value, once the stream has ended: ``IncompleteOutputError`` when the reply stopped
        before the value was complete (``max_tokens``, ``close()``); the turn is committed as far as it
        went either way."""
        if not self.stream.closed:
            raise ChatKitError("The stream has not ended yet: iterate it to the end (or close it) first.")
        return self.constraint.finish(self.stream.tokens)

    def result(self) -> Any:
        """The value (see :attr:`value`)."""
        return self.value

    text = property(lambda self: self.stream.text, doc="The reply's text so far (the value's JSON or text).")
    reasoning = property(lambda self: self.stream.reasoning, doc="The reasoning before the value, if any.")
    tool_calls = property(lambda self: self.stream.tool_calls, doc="Always empty: a guided reply calls no tools.")
    tokens = property(lambda self: self.stream.tokens, doc="Token ids generated so far.")
    finish_reason = property(lambda self: self.stream.finish_reason, doc="As the stream's.")
    stats = property(lambda self: self.stream.stats, doc="The turn's ``TurnStats`` once closed.")
    closed = property(lambda self: self.stream.closed, doc="Whether the reply has ended.")

    def __next__(self) -> StreamChunk:
        return next(self.stream)

    def close(self) -> None:
        self.stream.close()

    def discard(self) -> None:
        self.stream.discard()

    @property
    def discarded(self) -> bool:
        return self.stream.discarded

    def __del__(self) -> None:
        pass  # the inner stream closes itself when it is dropped


def _compaction(fit: Any) -> dict[str, Any]:
    if fit is None or not fit.compacted:
        return {}
    return {"compacted": True, "dropped_tokens": fit.dropped_tokens, "summary_tokens": fit.summary_tokens}


def _plan_name(plan: Any) -> str | None:
    action = getattr(plan, "action", None)
    return None if action is None else str(getattr(action, "value", action))


__all__ = ["GuidedStream", "ReplyStream", "ResponseStream", "drain", "StreamChunk", "TurnResult", "TurnStats", "TurnSteps", "ValueReader"]
