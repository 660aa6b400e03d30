"""The local token source: mlx-lm's ``generate_step`` (or ``speculative_generate_step`` with a draft
model) over one session's cache, in this process."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream, speculative_generate_step, wired_limit

from ..cache.state import CacheState
from ..params import LogitsProcessor
from ..speculative import SpeculativeConfig
from . import Request, Token


class LocalSource:
    """Tokens from ``model`` in this process; speculative when given a ``SpeculativeConfig``."""

    def __init__(self, model: Any, speculative: SpeculativeConfig | None = None) -> None:
        self.model = model
        self.speculative = speculative
        self.num_draft_tokens = speculative.num_draft_tokens if speculative is not None else 0

    def generate(self, cache: CacheState, request: Request) -> Iterator[Token]:
        assert cache.layers is not None, "prepare the cache before generating"
        processors = with_context(request.logits_processors, request.context)
        if self.speculative is None:
            return standard_tokens(self.model, cache.layers, request, processors)
        assert cache.draft_layers is not None, "a speculative session's cache has draft layers"
        draft = self.speculative
        return speculative_tokens(
            self.model, cache.layers, draft.draft.model, cache.draft_layers, draft.num_draft_tokens, request, processors
        )


def with_context(processors: Sequence[LogitsProcessor], context: Sequence[int]) -> list[LogitsProcessor]:
    """Processors that see ``context`` (the cached tokens) before the tokens of this call.

    generate_step shows processors only the tokens it was fed; over a reused cache that would hide
    the earlier conversation from e.g. a repetition penalty, unlike a fresh prefill of the same prompt.
    """
    if not processors or not context:
        return list(processors)
    prefix = mx.array(list(context), dtype=mx.uint32)

    def wrap(processor: LogitsProcessor) -> LogitsProcessor:
        return lambda tokens, logits: processor(mx.concatenate([prefix, tokens.astype(mx.uint32)]), logits)

    return [wrap(p) for p in processors]


def standard_tokens(
    model: Any, layers: list[Any], request: Request, processors: list[LogitsProcessor]
) -> Iterator[Token]:
    """mlx-lm's ``generate_step``: feed ``request.suffix`` into ``layers`` (in place), yield tokens.
    When the consumer stops, the cache holds what was fed plus the tokens yielded."""
    options = request.options
    steps = generate_step(
        mx.array(request.suffix, dtype=mx.uint32),
        model,
        prompt_cache=layers,
        max_tokens=request.max_tokens,
        sampler=request.sampler,
        logits_processors=processors or None,
        prefill_step_size=options.prefill_step_size,
        kv_bits=options.kv_bits,
        kv_group_size=options.kv_group_size,
        quantized_kv_start=options.quantized_kv_start,
        prompt_progress_callback=request.progress,
    )
    with wired_limit(model, [generation_stream]):  # type: ignore[list-item]  # as mlx-lm calls it
        try:
            for token, logprobs in steps:
                yield int(token), logprobs, False
        finally:
            steps.close()


def speculative_tokens(
    model: Any,
    layers: list[Any],
    draft_model: Any,
    draft_layers: list[Any],
    num_draft: int,
    request: Request,
    processors: list[LogitsProcessor],
) -> Iterator[Token]:
    """mlx-lm's ``speculative_generate_step`` (the draft layers hold what ``layers`` hold before the
    suffix). It leaves the target cache one token short of what it yielded, except inside an accepted
    draft run: the caller reads the offsets back."""
    suffix, progress = request.suffix, request.progress
    prompt = mx.array(suffix, dtype=mx.uint32)
    # mlx-lm's speculative step reports no prefill progress and shows logits processors none of
    # the prompt but its last token: prefill the rest here, in its chunks, and hand it one token.
    # mlx-lm splits the cache list at len(model.layers): target layers first, then the draft's.
    steps = speculative_generate_step(
        prompt[-1:], model, draft_model,
        prompt_cache=[*layers, *draft_layers],
        num_draft_tokens=num_draft,
        max_tokens=request.max_tokens,
        sampler=request.sampler,
        logits_processors=with_context(processors, suffix[:-1]) or None,
        prefill_step_size=request.options.prefill_step_size,
    )
    with wired_limit(model, [generation_stream]):  # type: ignore[list-item]  # as mlx-lm calls it
        try:
            _prefill_both(model, layers, draft_model, draft_layers, prompt, request.options.prefill_step_size, progress)
            for i, (token, logprobs, from_draft) in enumerate(steps):
                if i == 0 and progress is not None:  # the prompt is in once the first token is out
                    progress(len(suffix), len(suffix))
                yield int(token), logprobs, bool(from_draft)
        finally:
            steps.close()


def _prefill_both(model: Any, layers: list[Any], draft_model: Any, draft_layers: list[Any], prompt: mx.array,
                  step: int, progress: Callable[[int, int], None] | None) -> None:
    """Feed all of ``prompt`` but its last token to both models, in chunks of ``step`` as mlx-lm does."""
    total, done = prompt.size, 0
    if progress is not None:
        progress(0, total)
    with mx.stream(generation_stream):
        while total - done > 1:
            n = min(step, total - 1 - done)
            chunk = prompt[done : done + n][None]
            draft_model(chunk, cache=draft_layers)
            model(chunk, cache=layers)
            mx.eval([c.state for c in (*draft_layers, *layers)])
            done += n
            if progress is not None:
                progress(done, total)
            mx.clear_cache()


__all__ = ["LocalSource", "speculative_tokens", "standard_tokens", "with_context"]
