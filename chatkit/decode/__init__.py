"""Token sources: what turns a prepared prompt into generated tokens.

A turn hands a source its cache and a :class:`Request` (plain data) and reads back :class:`TokenEvent` s.
``local.py`` is mlx-lm's ``generate_step`` or chatkit's speculative loop over one session's cache; a
batching engine, a sharded model or a constrained decoder stands in behind the same two names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx

from ..cache.state import CacheOptions, CacheState
from ..model.switchable import ActiveAdapter
from ..model.vision import VisionInput
from ..params import LogitsProcessor, Sampler


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token: its id, the log-probabilities it was sampled from, and whether a draft
    (a draft model or prompt lookup) proposed it."""

    id: int
    logprobs: mx.array
    from_draft: bool = False



ProgressCallback = Callable[[int, int], None]


@dataclass
class DraftCount:
    """What speculative decoding did in one turn: tokens drafted, accepted, and the steps that drafted."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        """One drafting step: ``drafted`` tokens proposed, ``accepted`` of them kept."""
        self.drafted, self.accepted, self.steps = self.drafted + drafted, self.accepted + accepted, self.steps + 1


@dataclass(frozen=True)
class Request:
    """What a turn asks of a token source.

    ``suffix`` goes into the cache after the ``context`` it holds already (never empty); logits
    processors see ``context`` + ``suffix`` + the tokens generated, as a fresh prefill would show them.
    ``progress(done, total)`` is called while ``suffix`` is prefilled.
    """

    suffix: tuple[int, ...]
    context: tuple[int, ...]
    max_tokens: int
    sampler: Sampler
    logits_processors: Sequence[LogitsProcessor]
    options: CacheOptions
    progress: ProgressCallback | None = None
    drafts: DraftCount = field(default_factory=DraftCount)
    """Where a speculative source counts its drafting (the turn reads it for its stats)."""
    adapter: ActiveAdapter | None = None
    """The session's adapter, applied to the model's forward passes of this turn (``None``: the base)."""
    vision: VisionInput | None = None
    """A vision-language prompt: the input embeddings of ``suffix`` (its images' features in place) and
    the model to call for this turn instead of the source's (bound to the prompt's positions)."""


class TokenSource(Protocol):
    """Generates a turn's tokens over a session's cache."""

    def generate(self, cache: CacheState, request: Request) -> Iterator[TokenEvent]:
        """Feed ``request.suffix`` into ``cache`` (its layers updated in place) and yield tokens.

        When the consumer stops, the cache holds what was fed plus the tokens yielded (a speculative
        run may leave the last one out): the caller reads the offsets back, it does not count.
        """
        ...


__all__ = ["DraftCount", "ProgressCallback", "Request", "TokenEvent", "TokenSource", "VisionInput"]
