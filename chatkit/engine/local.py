"""The local token source: mlx-lm's ``generate_step`` (or ``speculative_generate_step`` with a draft
model) over one session's cache, in this process."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream, speculative_generate_step, wired_limit

from ..cache.state import CacheOptions, CacheState
from ..params import LogitsProcessor, Sampler
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
        spec = self.speculative
        draft = None if spec is None else (spec.draft.model, cache.draft_layers, spec.num_draft_tokens)
        return generate_tokens(
            self.model,
            cache.layers,
            request.suffix,
            max_tokens=request.max_tokens,
            sampler=request.sampler,
            logits_processors=with_context(request.logits_processors, request.context),
            options=request.options,
            progress=request.progress,
            draft=draft,
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


def generate_tokens(
    model: Any,
    layers: list[Any],
    suffix: Sequence[int],
    *,
    max_tokens: int,
    sampler: Sampler,
    logits_processors: Sequence[LogitsProcessor],
    options: CacheOptions,
    progress: Callable[[int, int], None] | None = None,
    draft: tuple[Any, list[Any], int] | None = None,
) -> Iterator[Token]:
    """Feed ``suffix`` into ``layers`` (updated in place) and yield generated tokens.

    With ``draft = (draft_model, draft_layers, num_draft_tokens)`` decoding is speculative (the draft
    layers must hold what ``layers`` hold before ``suffix``). When the consumer stops, the cache holds
    what was fed plus the tokens yielded (a speculative run may leave the last one out).
    """
    prompt = mx.array(list(suffix), dtype=mx.uint32)
    common = dict(
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=list(logits_processors) or None,
        prefill_step_size=options.prefill_step_size,
    )
    if draft is None:
        steps = generate_step(
            prompt,
            model,
            prompt_cache=layers,
            kv_bits=options.kv_bits,
            kv_group_size=options.kv_group_size,
            quantized_kv_start=options.quantized_kv_start,
            prompt_progress_callback=progress,
            **common,
        )
        tokens = ((token, logprobs, False) for token, logprobs in steps)
    else:
        # mlx-lm's speculative step reports no prefill progress and shows logits processors none of
        # the prompt but its last token: prefill the rest here, in its chunks, and hand it one token.
        draft_model, draft_layers, num_draft = draft
        common["logits_processors"] = with_context(logits_processors, suffix[:-1]) or None
        # mlx-lm splits the list at len(model.layers): target layers first, then the draft's.
        tokens = steps = speculative_generate_step(
            prompt[-1:], model, draft_model, prompt_cache=[*layers, *draft_layers], num_draft_tokens=num_draft,
            **common,
        )
    with wired_limit(model, [generation_stream]):
        try:
            if draft is not None:
                _prefill_both(model, layers, draft_model, draft_layers, prompt, options.prefill_step_size, progress)
                first = next(steps, None)
                if progress is not None:  # the prompt is in once the first token is out, as generate_step says
                    progress(len(suffix), len(suffix))
                if first is None:
                    return
                yield first
            yield from tokens
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


__all__ = ["LocalSource", "generate_tokens", "with_context"]
