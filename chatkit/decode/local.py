"""The local token source: mlx-lm's ``generate_step`` over one session's cache, in this process; or
chatkit's speculative loop (``speculative/loop.py``: a draft model or prompt lookup, a fixed or
adaptive draft length). What both share: logits processors that see the cached context."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream, wired_limit

from ..cache.state import CacheState
from ..model.switchable import ActiveAdapter, applying, each_step
from ..params import LogitsProcessor
from . import Request, TokenEvent
from .speculative import SpeculativeConfig, new_policy
from .speculative.costs import pair_key
from .speculative.loop import prefill, speculate


class LocalSource:
    """Tokens from ``model`` in this process; speculative when given a ``SpeculativeConfig``.

    The draft-length policy lives as long as the source (one per session), so what drafting
    achieved in earlier turns sets the length of the next turn's drafts; an adaptive one starts from
    what the process's earlier sessions learned about the same (target, draft) pair.
    """

    def __init__(self, model: Any, speculative: SpeculativeConfig | None = None) -> None:
        self.model = model
        self.speculative = speculative
        self.policy = None
        if speculative is not None:
            draft = speculative.draft_model
            key = pair_key(model, None if draft is None else draft.model) if speculative.adaptive else None
            self.policy = new_policy(speculative.num_draft_tokens, draft_model=draft is not None, key=key)

    def generate(self, cache: CacheState, request: Request) -> Iterator[TokenEvent]:
        assert cache.layers is not None, "prepare the cache before generating"
        processors = with_context(request.logits_processors, request.context)
        if request.vision is not None:  # a vision prompt: its embeddings through the model bound to its positions
            steps = standard_tokens(request.vision.model, cache.layers, request, processors)
        elif self.speculative is None or self.policy is None:
            steps = standard_tokens(self.model, cache.layers, request, processors)
        else:
            steps = speculate(self.model, cache, self.speculative, self.policy, request, processors)
        return steps if request.adapter is None else each_step(self.model, request.adapter, steps)


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
) -> Iterator[TokenEvent]:
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
        input_embeddings=None if request.vision is None else request.vision.embeddings,
    )
    with wired_limit(model, [generation_stream]):  # type: ignore[list-item]  # as mlx-lm calls it
        try:
            for token, logprobs in steps:
                yield TokenEvent(int(token), logprobs)
        finally:
            steps.close()


def fill(cache: CacheState, prompt: Sequence[int], model: Any, draft_model: Any = None,
         adapter: ActiveAdapter | None = None) -> None:
    """Prefill ``prompt`` into ``cache`` (reusing what it holds; a draft's layers too) without generating:
    a context prepared ahead of the turn that will use it (through ``adapter``, the session's)."""
    plan = cache.prepare(prompt)
    assert cache.layers is not None
    models = [(model, cache.layers)]
    if draft_model is not None and cache.draft_layers is not None:
        models.append((draft_model, cache.draft_layers))
    with mx.stream(generation_stream), applying(model, adapter):
        prefill(models, plan.suffix, cache.options.prefill_step_size, None, len(plan.suffix))
    cache.record(plan.suffix)


__all__ = ["LocalSource", "fill", "standard_tokens", "with_context"]
