"""chatkit's speculative loop: a drafter proposes tokens, the target checks them all in one step.

chatkit's own loop, not mlx-lm's ``speculative_generate_step``: that one fixes the draft length for a
whole call and drafts only with a model. Plain steps are queued one ahead of the token they yield, as
in generate_step. A drafting step feeds the next token and its drafts to the target at once, samples
the target's positions in order until one differs from its draft, and trims the rejected drafts from
the cache: greedy output is exactly standard decoding's, and a seeded sampler draws as many random
numbers, in the same order, as standard decoding.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream, maybe_quantize_kv_cache, wired_limit

from ...cache._mlx import layer_offset, speculation_room, trim_layers
from ...cache.state import CacheState
from ...params import LogitsProcessor
from .. import Request, TokenEvent
from .config import SpeculativeConfig
from .drafters import Drafter, LookupDrafter, ModelDrafter
from .lookup import NgramIndex
from .policy import DraftPolicy, choose, new_turn, record_draft, record_miss, record_plain

clock = time.perf_counter
"""The clock the draft-length policy's measurements read (tests give their own)."""

Steps = Generator[TokenEvent, None, tuple[mx.array, mx.array]]
"""A step's tokens, then the next token to feed and its log-probabilities."""


def speculate(model: Any, cache: CacheState, config: SpeculativeConfig, policy: DraftPolicy, request: Request,
              processors: Sequence[LogitsProcessor]) -> Iterator[TokenEvent]:
    """:func:`speculative_tokens` over ``cache`` with the drafter ``config`` names: its draft model
    (prefilled along with the target, into the cache's draft layers) or prompt lookup."""
    assert cache.layers is not None, "prepare the cache before generating"
    draft = config.draft_model
    if draft is not None:
        assert cache.draft_layers is not None, "a session with a draft model has draft layers"
        drafter = ModelDrafter(draft.model, cache.draft_layers, processors, request.suffix[:-1])
        return speculative_tokens(model, cache.layers, drafter, policy, request, processors,
                                  also_prefill=(draft.model, cache.draft_layers))
    index = NgramIndex([*request.context, *request.suffix], config.ngram_min, config.ngram_max)
    lookup = LookupDrafter(index, len(request.suffix))
    return speculative_tokens(model, cache.layers, lookup, policy, request, processors)


@dataclass(eq=False)
class _Run:
    """One call of the loop: its inputs, what was fed and yielded so far, and the step to time."""

    model: Any
    layers: list[Any]
    drafter: Drafter
    policy: DraftPolicy
    request: Request
    processors: Sequence[LogitsProcessor]
    prefix: list[int]  # what processors see before ``held``: the suffix but its last token
    held: list[int] = field(default_factory=list)  # fed to the target after the prefill (suffix's last first)
    out: int = 0  # tokens yielded
    base: int = 0  # the target's offset after the prefill
    last: tuple[int, int, bool] | None = None  # the previous step to time: (drafted, accepted, probe)
    t_last: float = 0.0
    shown: mx.array | None = None  # ``prefix + held`` as an array, for the processors (grown, not rebuilt)

    def line(self) -> mx.array:
        """``prefix + held`` as an array: extended by what ``held`` gained since the last call, so a
        plain step costs the processors' context as mlx-lm's does (not a list converted per step)."""
        have = 0 if self.shown is None else self.shown.size
        new = self.held[have - len(self.prefix):] if have else self.prefix + self.held
        if self.shown is None or new:
            tail = mx.array(new, dtype=mx.uint32)
            self.shown = tail if self.shown is None else mx.concatenate([self.shown, tail])
        return self.shown


def speculative_tokens(
    model: Any,
    layers: list[Any],
    drafter: Drafter,
    policy: DraftPolicy,
    request: Request,
    processors: Sequence[LogitsProcessor],
    also_prefill: tuple[Any, list[Any]] | None = None,
) -> Iterator[TokenEvent]:
    """Feed ``request.suffix`` into ``layers`` (in place; also into ``also_prefill`` = (draft model,
    its layers)) and yield tokens, checking the drafts of ``drafter`` when ``policy`` says. Counts go
    to ``request.drafts``. When the consumer stops, the cache holds what was fed plus the tokens
    yielded (perhaps without the last)."""
    new_turn(policy)
    run = _Run(model, layers, drafter, policy, request, processors, list(request.suffix[:-1]))
    models = [(model, layers), *([also_prefill] if also_prefill is not None else [])]
    step = request.options.prefill_step_size
    with wired_limit(model, [generation_stream]), mx.stream(generation_stream):  # type: ignore[list-item]
        prefill(models, run.prefix, step, request.progress, len(request.suffix), after_chunk=lambda: _quantize(run))
        run.base = layer_offset(layers) or 0
        try:
            yield from _decode(run)
        finally:
            _stop(run)


def _decode(run: _Run) -> Iterator[TokenEvent]:
    """The suffix's last token fed, then steps until ``max_tokens``: plain, or drafting when the policy says."""
    suffix, max_tokens, progress = run.request.suffix, run.request.max_tokens, run.request.progress
    y, logprobs = _plain_step(run, mx.array([suffix[-1]], dtype=mx.uint32))
    run.held.append(suffix[-1])
    mx.eval(y, logprobs)  # the log-probabilities too (no more work): a turn may read them on another thread
    if progress is not None:
        progress(len(suffix), len(suffix))
    queued = False  # y comes from a plain step queued one ahead (its time is a step's)
    while run.out < max_tokens:
        k, probe = _draft_length(run, y)
        drafts = run.drafter.propose(y, k, run.held) if k > 0 else None
        if drafts is not None and drafts.size == 0:
            record_miss(run.policy, probe)
        if drafts is None or drafts.size == 0:
            y, logprobs = yield from _plain(run, y, logprobs, queued)
            queued = True
        else:
            y, logprobs = yield from _drafting(run, y, logprobs, drafts, probe)
            queued = False
    _lap(run)


def _draft_length(run: _Run, y: mx.array) -> tuple[int, bool]:
    """How many tokens to draft after ``y`` (0: a plain step) and whether that is a probe. The
    previous step is timed here: a drafting round (its tokens are at hand) before the choice, a plain
    step queued ahead when ``y`` (its token) is ready, or at the next step when it stays queued."""
    if run.last is not None and run.last[0]:
        _lap(run)
    options = run.request.options
    k, probe = choose(run.policy)
    if k > 0:  # a rotating cache's room, a cache about to be quantized: drafts stop where exactness would
        room = speculation_room(run.layers, options.kv_bits, options.quantized_kv_start)
        k = min(k, run.request.max_tokens - run.out - 1, room)
    if k > 0:
        mx.eval(y)
    _lap(run)
    if k > 0:  # the draft model's catch-up after plain steps is part of this round's time: it is what
        run.drafter.catch_up(run.held)  # a probe costs beyond its round (left out, probes looked cheap)
    return k, probe


def _lap(run: _Run) -> None:
    """The step to time (if any) ends now; the next starts."""
    now = clock()
    if run.last is not None:
        _record(run.policy, *run.last, now - run.t_last)
    run.t_last, run.last = now, None


def _plain(run: _Run, y: mx.array, logprobs: mx.array, queued: bool) -> Steps:
    """A plain step: yield ``y``, the step that makes the next token queued before ``y`` is read (as
    generate_step does). Returns that next token (``y`` again after the last token)."""
    following = None
    if run.out + 1 < run.request.max_tokens:
        following = _plain_step(run, y)
        mx.async_eval(*following)
    token = _int(y)
    run.held.append(token)
    run.last = (0, 0, False) if queued else None
    run.out += 1
    yield TokenEvent(token, logprobs)
    return following if following is not None else (y, logprobs)


def _drafting(run: _Run, y: mx.array, logprobs: mx.array, drafts: mx.array, probe: bool) -> Steps:
    """A drafting step: ``y`` and ``drafts`` checked by the target at once. Yields ``y`` and the
    accepted drafts; returns the token the target chose after them."""
    drafted = drafts.size
    taken, step_logprobs, token = _verify(run, y, logprobs, drafts)
    _accept(run, taken, drafted, probe)
    for j, t in enumerate(taken):
        run.out += 1
        yield TokenEvent(t, step_logprobs[j], j > 0)
        if run.out == run.request.max_tokens:
            break
    return mx.array([token], dtype=mx.uint32), step_logprobs[-1]


def _verify(run: _Run, y: mx.array, logprobs: mx.array, drafts: mx.array) -> tuple[list[int], list[mx.array], int]:
    """Feed ``y`` and ``drafts`` to the target and sample its positions in order until one differs
    from its draft. Returns the tokens taken (``y``, the accepted drafts), the log-probabilities of
    each (``logprobs`` first) and of the target's token after them, and that token."""
    k = drafts.size
    logits = run.model(mx.concatenate([y, drafts])[None], cache=run.layers)
    mx.eval(logits, drafts)
    first, proposed = _int(y), [int(t) for t in drafts.tolist()]  # type: ignore[arg-type, union-attr]
    line = mx.array(run.prefix + run.held + [first] + proposed if run.processors else [], dtype=mx.uint32)
    n, step_logprobs = len(run.prefix) + len(run.held) + 1, [logprobs]
    for i in range(k + 1):
        sampled, logprobs_i = _sample(run, logits[:, i, :], lambda end=n + i, line=line: line[:end])  # type: ignore[misc]
        step_logprobs.append(logprobs_i)
        mx.eval(sampled, logprobs_i)  # as in _decode
        token = _int(sampled)
        if i == k or token != proposed[i]:
            break
    return [first, *proposed[: len(step_logprobs) - 2]], step_logprobs, token


def _accept(run: _Run, taken: list[int], drafted: int, probe: bool) -> None:
    """The step's ``taken`` tokens stand: the rejected drafts leave both caches; the counts and the
    step to time are noted."""
    run.held.extend(taken)
    trim_layers(run.layers, run.base + len(run.held))  # the rejected drafts leave the cache
    _quantize(run)  # after the trim: at the offset one-token steps would have reached
    run.drafter.rewind(len(run.held))
    accepted = len(taken) - 1
    run.request.drafts.add(drafted, accepted)
    run.last = (drafted, accepted, probe)


def _stop(run: _Run) -> None:
    """Stopped inside a step: neither cache keeps a token past the last one yielded."""
    keep = 1 + run.out  # the suffix's last token, then the tokens yielded
    if (layer_offset(run.layers) or 0) > run.base + keep:
        trim_layers(run.layers, run.base + keep)
    run.drafter.rewind(keep)


def _plain_step(run: _Run, y: mx.array) -> tuple[mx.array, mx.array]:
    """Feed ``y`` to the target; the next token and its log-probabilities (lazy)."""
    logits = run.model(y[None], cache=run.layers)[:, -1, :]
    _quantize(run)
    return _sample(run, logits, lambda: mx.concatenate([run.line(), y]))


def _sample(run: _Run, logits: mx.array, shown: Callable[[], mx.array]) -> tuple[mx.array, mx.array]:
    """The sampled token and the log-probabilities of ``logits`` after the processors, which see
    ``shown()`` (the tokens up to this position)."""
    if run.processors:
        tokens = shown()
        for processor in run.processors:
            logits = processor(tokens, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return run.request.sampler(logprobs), logprobs.squeeze(0)


def _quantize(run: _Run) -> None:
    """Quantize the target's KV as generate_step does after each call of the model (``kv_bits``)."""
    options = run.request.options
    maybe_quantize_kv_cache(run.layers, options.quantized_kv_start, options.kv_group_size, options.kv_bits)


def _int(a: mx.array) -> int:
    return int(a.item())  # type: ignore[arg-type]


def _record(policy: DraftPolicy, drafted: int, accepted: int, probe: bool, seconds: float) -> None:
    if drafted:
        record_draft(policy, drafted, accepted, seconds, probe)
    else:
        record_plain(policy, seconds)


def prefill(models: Sequence[tuple[Any, list[Any]]], tokens: Sequence[int], step: int,
            progress: Callable[[int, int], None] | None, total: int,
            after_chunk: Callable[[], None] | None = None) -> None:
    """Feed ``tokens`` (a suffix but its last token) to each (model, layers), in chunks of ``step`` as
    generate_step does, reporting ``progress(done, total)``; ``after_chunk()`` runs after each chunk
    is fed (the target's KV quantization, as generate_step quantizes after each chunk)."""
    done = 0
    if progress is not None:
        progress(0, total)
    while done < len(tokens):
        n = min(step, len(tokens) - done)
        chunk = mx.array(list(tokens[done : done + n]), dtype=mx.uint32)[None]
        for model, layers in models:
            model(chunk, cache=layers)
        if after_chunk is not None:
            after_chunk()
        mx.eval([c.state for _, layers in models for c in layers])
        done += n
        if progress is not None:
            progress(done, total)
        mx.clear_cache()


__all__ = ["prefill", "speculate", "speculative_tokens"]
