"""Where a request's time goes: ``time.perf_counter_ns()`` stamps at each stage of one request, taken
only when the client asks with the header ``X-Chatkit-Trace: 1`` (``bench/server.py`` does); any other
request pays one context-variable read per stamp.

The stamps (nanoseconds of the monotonic clock, which on Linux every process on the machine shares, so
a client on the same host can set them against its own ``perf_counter_ns``) are sent back with the
reply: a streamed reply ends with the comment line ``: chatkit-trace {json}`` (server-sent events'
comments, which clients skip), any other reply has the header ``X-Chatkit-Trace: {json}``. The JSON is
``{"stamps": [[stage, ns], ...], "prefill_ms": ..., "prefilled_tokens": ...}``, stages in the order
they happened; each stage is stamped once (its first time).

Stages: ``handler`` (the endpoint was called: HTTP read and routed), ``body`` (read and parsed as JSON),
``parsed`` (checked and read into a ``TurnRequest``), ``slot`` (a place among the turns running),
``session`` (the pooled session found, or a new one built), ``opened`` (the turn opened: the prompt
rendered and tokenized), ``headers`` (the response's status and headers sent), ``turn`` (the handler
waits for the first token: the events before it were sent), ``token`` (the first token reached the event
loop: the hand-off to the turn's thread, the cache plan, the prefill, the hand-back), ``text`` (the
first event with text made), ``text_sent`` (... and written to the socket), ``settled`` (the turn
closed and the conversation re-indexed), ``stored`` (the response stored, Responses API).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterable, AsyncIterator
from contextvars import ContextVar
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..session.results import TurnStats

HEADER = "x-chatkit-trace"
COMMENT = ": chatkit-trace "


class Trace:
    """The stamps of one request (see the module docstring)."""

    def __init__(self) -> None:
        self.stamps: dict[str, int] = {"handler": time.perf_counter_ns()}
        self.notes: dict[str, Any] = {}

    def stamp(self, stage: str) -> None:
        """``stage`` happened now (only its first time counts)."""
        if stage not in self.stamps:
            self.stamps[stage] = time.perf_counter_ns()

    def turn(self, stats: TurnStats | None) -> None:
        """The turn's own figures: its prefill (first token's) time and the tokens it prefilled."""
        if stats is not None and "prefill_ms" not in self.notes:
            prefill = stats.prefilled_tokens / stats.prompt_tps if stats.prompt_tps > 0 else 0.0
            self.notes.update(prefill_ms=prefill * 1e3, prefilled_tokens=stats.prefilled_tokens)

    def json(self) -> str:
        return json.dumps({"stamps": list(self.stamps.items()), **self.notes}, separators=(",", ":"))


_current: ContextVar[Trace | None] = ContextVar("chatkit_server_trace", default=None)


def begin(request: Request) -> Trace | None:
    """A trace for this request if it asked for one (else ``None``), current for the rest of it."""
    trace = Trace() if request.headers.get(HEADER) else None
    _current.set(trace)  # also clears what an earlier request in this context left
    return trace


def stamp(stage: str) -> None:
    """Stamp ``stage`` on the current request's trace, if it has one."""
    trace = _current.get()
    if trace is not None:
        trace.stamp(stage)


def turn(stats: TurnStats | None) -> None:
    """Record the turn's figures on the current request's trace, if it has one."""
    trace = _current.get()
    if trace is not None:
        trace.turn(stats)


def attach(trace: Trace, response: Response) -> Response:
    """``response`` carrying ``trace``: a streamed one at its end (its sends stamped), else in a header."""
    if isinstance(response, StreamingResponse):
        response.body_iterator = _traced(trace, response.body_iterator)
    else:
        response.headers[HEADER] = trace.json()
    return response


async def _traced(trace: Trace, body: AsyncIterable[str | bytes | memoryview]) -> AsyncIterator[str | bytes | memoryview]:
    trace.stamp("headers")  # the response starts iterating its body once the headers are sent
    async for part in body:
        yield part
        if "text" in trace.stamps:  # back here: the part was written
            trace.stamp("text_sent")
    yield f"{COMMENT}{trace.json()}\n\n"


__all__ = ["COMMENT", "HEADER", "Trace", "attach", "begin", "stamp", "turn"]
