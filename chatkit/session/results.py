"""What a turn hands out: its chunks (``StreamChunk``), what it cost (``TurnStats``) and what it
commits (``TurnResult``): plain data."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..messages import ToolCall
from ..text.reply import PieceKind


@dataclass(frozen=True)
class StreamChunk:
    """One generated token and the text it completed (possibly ``""`` while a character is partial).

    ``kind`` (a :class:`PieceKind`, equal to its string) says what the text is: ``"text"`` (the answer),
    ``"reasoning"``, ``"tool_call"`` (the call's own text as it streams; the chunk that completes a call
    carries it in ``tool_call``) or, between the rounds of a tool loop, ``"tool_result"`` (``tool_call``
    names the call answered).
    Markers (``<think>``, ``<tool_call>`` ...) are never part of a chunk's text. A token whose text
    spans two kinds gives one chunk per kind, with the same ``token``. ``finish_reason`` is set on
    the last chunk: ``"stop"`` (end of turn or a stop string) or ``"length"`` (``max_tokens`` or the
    context window reached).
    """

    text: str
    token: int
    finish_reason: str | None = None
    from_draft: bool = False
    logprobs: mx.array | None = None
    kind: PieceKind = PieceKind.TEXT
    tool_call: ToolCall | None = None

    # ``logprobs`` is the step's log-softmax over the vocabulary: of the logits after the turn's logits
    # processors (logit_bias, penalties, constraints), before temperature and top-p/top-k/min-p.

    def token_logprob(self) -> float | None:
        """The log-probability of ``token`` at its step (``None`` for a chunk without one, a tool result)."""
        if self.logprobs is None:
            return None
        return float(self.logprobs.reshape(-1)[self.token].item())  # type: ignore[arg-type]

    def top_logprobs(self, k: int) -> list[tuple[int, float]]:
        """The step's ``k`` most likely tokens as (token id, log-probability), most likely first (ties:
        lower id first); computed on demand, so a turn that does not ask pays nothing."""
        if self.logprobs is None or k <= 0:
            return []
        row = self.logprobs.reshape(-1)
        k = min(k, row.size)
        ids = mx.argpartition(-row, kth=k - 1)[:k] if k < row.size else mx.arange(row.size)
        values = row[ids].tolist()
        return sorted(zip(ids.tolist(), values), key=lambda p: (-p[1], p[0]))  # type: ignore[arg-type]


@dataclass(frozen=True)
class TurnStats:
    """What a turn cost. ``reused_tokens + prefilled_tokens == prompt_tokens``.

    ``prompt_tps`` is prefilled tokens per second of prefill (time to the first token);
    ``generation_tps`` is generated tokens per second after the first one. ``finish_reason`` is
    ``"stop"``, ``"length"`` or ``"cancelled"`` (closed before the end). ``peak_memory_bytes`` is
    MLX's process-wide peak during the turn. With speculative decoding, ``draft_tokens_proposed``
    counts the drafted tokens, ``draft_tokens_accepted`` those the target kept, and ``draft_length``
    is the mean number drafted per drafting step (0.0 when no step drafted).
    ``plan`` is what
    the cache did before the prefill: ``"append"`` (the prompt extended it), ``"trim"`` (rewound to the
    common prefix, e.g. a template that drops old reasoning), ``"restore"`` (a checkpoint) or
    ``"rebuild"`` (nothing reusable); ``None`` when the turn never started. ``compacted``: the context
    policy dropped older exchanges from what the model sees this turn (``dropped_tokens`` fewer prompt
    tokens; ``summary_tokens`` in the new summary).
    """

    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_memory_bytes: int
    finish_reason: str | None
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    draft_length: float = 0.0
    plan: str | None = None
    compacted: bool = False
    dropped_tokens: int = 0
    summary_tokens: int = 0


@dataclass(frozen=True)
class TurnResult:
    """What a stream hands back to its session when it closes."""

    text: str  # the answer
    tokens: tuple[int, ...]  # every token the model produced, end-of-turn token included
    stats: TurnStats
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


__all__ = ["StreamChunk", "TurnResult", "TurnStats"]
