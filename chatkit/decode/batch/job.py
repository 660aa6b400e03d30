"""One turn inside a ``BatchEngine``: its inputs, its prefill on its own cache, its output queue, and
the cache handed back."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from ...cache._mlx import eval_layers
from ...params import LogitsProcessor, Sampler
from .. import DraftCount, TokenEvent
from ..speculative import DraftPolicy, SpeculativeConfig


@dataclass(frozen=True, slots=True)
class Progress:
    """The engine prefilled ``done`` of the job's ``total`` prompt tokens."""

    done: int
    total: int


@dataclass(frozen=True, slots=True)
class End:
    """The job left the engine: its reader stops (raising ``error`` when the job failed)."""

    error: BaseException | None = None


Event = TokenEvent | Progress | End
"""What a job's queue carries to the turn's reader."""


@dataclass(eq=False)
class Job:
    """One turn inside the engine. ``layers`` is the session's own cache list, emptied while the engine
    holds the cache (the prefill group, then the decode batch: the only copy) until it is handed back;
    the prompt is prefilled in chunks of at most ``step`` tokens."""

    suffix: tuple[int, ...]
    context: tuple[int, ...]
    max_tokens: int
    raw_sampler: Sampler
    raw_processors: tuple[LogitsProcessor, ...]
    layers: list[Any]
    step: int
    lookup: SpeculativeConfig | None = None  # prompt lookup inside the batch
    policy: DraftPolicy | None = None  # the session's draft-length policy (with ``lookup`` or ``draft``)
    drafts: DraftCount = field(default_factory=DraftCount)
    draft: Any = None  # the draft model (an mlx model) the turn drafts with inside the batch
    draft_layers: list[Any] | None = None  # the session's draft cache (emptied while the batch holds it)
    draft_back: list[Any] | None = None  # the draft cache handed back with ``handback``
    prefilled: int = 0  # tokens of ``suffix[:-1]`` fed
    delivered: int = 0  # tokens handed to the reader
    out: queue.SimpleQueue[Event] = field(default_factory=queue.SimpleQueue)
    finished: threading.Event = field(default_factory=threading.Event)
    handback: list[Any] | None = None
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.sampler = self._guarded_sampler()
        self.processors = tuple(self._guard(p) for p in self.raw_processors)
        self.greedy = self.raw_sampler is greedy_sampler

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= len(self.suffix) - 1

    def put(self, token: int, logprobs: mx.array, from_draft: bool) -> None:
        self.out.put(TokenEvent(token, logprobs, from_draft))

    def progress(self, done: int) -> None:
        """The prompt is prefilled up to ``done`` of its tokens."""
        self.out.put(Progress(done, len(self.suffix)))

    def finish(self, layers: list[Any] | None, error: BaseException | None = None) -> None:
        """The job leaves the engine: its cache (evaluated here, on the thread that computed it) or
        ``None``, then an end or an error for its reader."""
        if self.finished.is_set():
            return
        if layers is not None:
            try:
                eval_layers(layers + (self.draft_back or []))
            except Exception as exc:
                layers, error = None, error or exc
        self.handback = layers
        self.out.put(End(error))
        self.finished.set()

    def _guarded_sampler(self) -> Sampler:
        if self.raw_sampler is greedy_sampler:  # cannot fail; kept as is, greedy rows sample in one call
            return greedy_sampler

        def sample(logprobs: mx.array) -> mx.array:
            if self.error is None:
                try:
                    return self.raw_sampler(logprobs)
                except Exception as exc:
                    self.error = exc
            return mx.argmax(logprobs, axis=-1)

        return sample

    def _guard(self, processor: LogitsProcessor) -> LogitsProcessor:
        def process(tokens: mx.array, logits: mx.array) -> mx.array:
            if self.error is None:
                try:
                    return processor(tokens, logits)
                except Exception as exc:
                    self.error = exc
            return logits

        return process


__all__ = ["End", "Event", "Job", "Progress"]
