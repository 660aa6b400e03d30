"""The local token source: mlx-lm's ``generate_step`` over one session's cache, in this process; or
chatkit's speculative loop (a draft model or prompt lookup, a fixed or adaptive draft length)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream, maybe_quantize_kv_cache, wired_limit

from ..cache._mlx import layer_offset, speculation_room, trim_layers
from ..cache.state import CacheState
from ..params import LogitsProcessor
from . import Request, Token
from .speculative import NgramIndex, SpeculativeConfig, new_policy
from .speculative.policy import DraftPolicy, choose, new_turn, record_draft, record_miss, record_plain


class LocalSource:
    """Tokens from ``model`` in this process; speculative when given a ``SpeculativeConfig``.

    The draft-length policy lives as long as the source (one per session), so what drafting
    achieved in earlier turns sets the length of the next turn's drafts.
    """

    def __init__(self, model: Any, speculative: SpeculativeConfig | None = None) -> None:
        self.model = model
        self.speculative = speculative
        self.policy = None if speculative is None else new_policy(
            speculative.num_draft_tokens, draft_model=speculative.draft_model is not None
        )

    def generate(self, cache: CacheState, request: Request) -> Iterator[Token]:
        assert cache.layers is not None, "prepare the cache before generating"
        processors = with_context(request.logits_processors, request.context)
        spec, policy = self.speculative, self.policy
        if spec is None or policy is None:
            return standard_tokens(self.model, cache.layers, request, processors)
        if spec.draft_model is not None:
            assert cache.draft_layers is not None, "a session with a draft model has draft layers"
            draft = spec.draft_model.model
            drafter = model_drafter(draft, cache.draft_layers, processors, request.suffix[:-1])
            return speculative_tokens(self.model, cache.layers, drafter, policy, request, processors,
                                      also_prefill=(draft, cache.draft_layers))
        index = NgramIndex([*request.context, *request.suffix], spec.ngram_min, spec.ngram_max)
        drafter = lookup_drafter(index, len(request.suffix))
        return speculative_tokens(self.model, cache.layers, drafter, policy, request, processors)


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


class Drafter:
    """Proposes tokens for :func:`speculative_tokens`: a draft model or prompt lookup.

    ``catch_up(held)``: take in ``held``, the tokens fed to the target in this call after its
    prefill (a draft model feeds those it has not seen, e.g. after plain steps).
    ``propose(y, k, held)``: up to ``k`` tokens to follow ``held`` and ``y`` (the next token, not fed
    yet), as an ``mx.array`` (maybe lazy). ``rewind(n)``: only the first ``n`` tokens of ``held``
    stand (drafts were rejected).
    """

    def __init__(self, catch_up: Callable[[list[int]], None], propose: Callable[[mx.array, int, list[int]], mx.array],
                 rewind: Callable[[int], None]):
        self.catch_up, self.propose, self.rewind = catch_up, propose, rewind


def model_drafter(draft_model: Any, draft_layers: list[Any], processors: Sequence[LogitsProcessor],
                  prefix: Sequence[int]) -> Drafter:
    """Drafts with ``draft_model``, whose layers will hold what the target's hold once ``prefix``
    (the suffix but its last token) is prefilled into both.

    Drafts are greedy whatever the sampler: a draft only has to be likely, and drawing no random
    numbers keeps a seeded turn's draws those of standard decoding. Logits processors (a penalty, a
    grammar) shape the draft as they shape the target, so that the two agree more often.
    """
    base = (layer_offset(draft_layers) or 0) + len(prefix)
    fed = [0]  # tokens of ``held`` (or drafts past it) in the draft's cache

    def catch_up(held: list[int]) -> None:
        lag = held[fed[0]:]  # the tokens decoded without drafting since the draft last ran
        if lag:
            draft_model(mx.array(lag, dtype=mx.uint32)[None], cache=draft_layers)
            mx.eval([c.state for c in draft_layers])
            fed[0] = len(held)

    def propose(y: mx.array, k: int, held: list[int]) -> mx.array:
        lag = held[fed[0]:]
        inp = mx.concatenate([mx.array(lag, dtype=mx.uint32), y]) if lag else y
        shown = mx.array([*prefix, *held], dtype=mx.uint32) if processors else None
        drafts: list[mx.array] = []
        for _ in range(k):
            logits = draft_model(inp[None], cache=draft_layers)[:, -1, :]
            if shown is not None:
                seen = mx.concatenate([shown, y, *drafts])
                for processor in processors:
                    logits = processor(seen, logits)
            inp = mx.argmax(logits, axis=-1).astype(mx.uint32)
            mx.async_eval(inp)
            drafts.append(inp)
        fed[0] = len(held) + k  # y and every draft but the last
        return mx.concatenate(drafts)

    def rewind(n: int) -> None:
        if fed[0] > n:
            trim_layers(draft_layers, base + n)
            fed[0] = n

    return Drafter(catch_up, propose, rewind)


def lookup_drafter(index: NgramIndex, indexed: int) -> Drafter:
    """Drafts the continuation of the last n-gram's earlier occurrence. ``index`` holds the cached
    tokens and the first ``indexed`` tokens that ``held`` will hold (the suffix)."""
    done = [indexed]

    def catch_up(held: list[int]) -> None:
        index.extend(held[done[0]:])
        done[0] = len(held)

    def propose(y: mx.array, k: int, held: list[int]) -> mx.array:
        catch_up(held)
        index.extend([_int(y)])
        done[0] += 1  # y is fed next
        return mx.array(index.propose(k), dtype=mx.uint32)

    return Drafter(catch_up, propose, lambda n: None)


def speculative_tokens(
    model: Any,
    layers: list[Any],
    drafter: Drafter,
    policy: DraftPolicy,
    request: Request,
    processors: Sequence[LogitsProcessor],
    also_prefill: tuple[Any, list[Any]] | None = None,
) -> Iterator[Token]:
    """Feed ``request.suffix`` into ``layers`` (in place; also into ``also_prefill`` = (draft model,
    its layers)) and yield tokens, checking the drafts of ``drafter`` when ``policy`` says. Counts go
    to ``request.drafts``. When the consumer stops, the cache holds what was fed plus the tokens
    yielded (perhaps without the last).

    chatkit's own loop, not mlx-lm's ``speculative_generate_step``: that one fixes the draft length
    for a whole call and drafts only with a model. Plain steps are queued one ahead of the token
    they yield, as in generate_step. A drafting step feeds the next token and its drafts to the
    target at once, samples the target's positions in order until one differs from its draft, and
    trims the rejected drafts from the cache: greedy output is exactly standard decoding's, and a
    seeded sampler draws as many random numbers, in the same order, as standard decoding.
    """
    new_turn(policy)
    suffix, counts, sampler = list(request.suffix), request.drafts, request.sampler
    max_tokens, progress, options = request.max_tokens, request.progress, request.options
    prefix = suffix[:-1]  # what processors see before ``held``
    held: list[int] = []  # tokens fed to the target after the prefill (the suffix's last one first)
    out = 0  # tokens yielded

    def sample(logits: mx.array, shown: Callable[[], mx.array]) -> tuple[mx.array, mx.array]:
        if processors:
            tokens = shown()
            for processor in processors:
                logits = processor(tokens, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return sampler(logprobs), logprobs.squeeze(0)

    def quantize() -> None:  # as generate_step does after each call of the model (kv_bits)
        maybe_quantize_kv_cache(layers, options.quantized_kv_start, options.kv_group_size, options.kv_bits)

    def plain_step(y: mx.array) -> tuple[mx.array, mx.array]:
        logits = model(y[None], cache=layers)[:, -1, :]
        quantize()
        return sample(logits, lambda: mx.concatenate([mx.array(prefix + held, dtype=mx.uint32), y]))

    models = [(model, layers), *([also_prefill] if also_prefill is not None else [])]
    with wired_limit(model, [generation_stream]), mx.stream(generation_stream):  # type: ignore[list-item]
        prefill(models, prefix, options.prefill_step_size, progress, len(suffix), after_chunk=quantize)
        base = layer_offset(layers) or 0
        try:
            y, logprobs = plain_step(mx.array(suffix[-1:], dtype=mx.uint32))
            held.append(suffix[-1])
            mx.eval(y)
            if progress is not None:
                progress(len(suffix), len(suffix))
            queued = False  # y comes from a plain step queued one ahead (its time is a step's)
            last: tuple[int, int, bool] | None = None  # the previous step to time: (drafted, accepted, probe)
            t_last = 0.0
            while out < max_tokens:
                k, probe = choose(policy)
                # A rotating cache's room, a cache about to be quantized: drafts stop where exactness would.
                k = min(k, max_tokens - out - 1, speculation_room(layers, options.kv_bits, options.quantized_kv_start))
                if k > 0:  # the step that made y belongs to the last step's time; a catch-up to none
                    mx.eval(y)
                    drafter.catch_up(held)
                now = time.perf_counter()
                if last is not None:
                    _record(policy, *last, now - t_last)
                t_last, last = now, None
                drafts = drafter.propose(y, k, held) if k > 0 else None
                if drafts is not None and drafts.size == 0:
                    record_miss(policy, probe)
                if drafts is None or drafts.size == 0:
                    if out + 1 < max_tokens:
                        next_y, next_logprobs = plain_step(y)  # queued before y is read, as generate_step does
                        mx.async_eval(next_y, next_logprobs)
                    token = _int(y)
                    held.append(token)
                    last = (0, 0, False) if queued else None
                    out += 1
                    yield token, logprobs, False
                    if out < max_tokens:
                        y, logprobs, queued = next_y, next_logprobs, True
                    continue
                k = drafts.size
                logits = model(mx.concatenate([y, drafts])[None], cache=layers)
                mx.eval(logits, drafts)
                first, proposed = _int(y), [int(t) for t in drafts.tolist()]  # type: ignore[arg-type, union-attr]
                line = mx.array(prefix + held + [first] + proposed if processors else [], dtype=mx.uint32)
                n, step_logprobs = len(prefix) + len(held) + 1, [logprobs]
                for i in range(k + 1):
                    sampled, logprobs_i = sample(logits[:, i, :], lambda end=n + i, line=line: line[:end])  # type: ignore[misc]
                    step_logprobs.append(logprobs_i)
                    token_i = _int(sampled)
                    if i == k or token_i != proposed[i]:
                        break
                accepted = len(step_logprobs) - 2
                taken = [first, *proposed[:accepted]]
                held.extend(taken)
                trim_layers(layers, base + len(held))  # the rejected drafts leave the cache
                quantize()  # after the trim: at the offset one-token steps would have reached
                drafter.rewind(len(held))
                counts.drafted, counts.accepted, counts.steps = (
                    counts.drafted + k, counts.accepted + accepted, counts.steps + 1)
                last = (k, accepted, probe)
                for j, token in enumerate(taken):
                    out += 1
                    yield token, step_logprobs[j], j > 0
                    if out == max_tokens:
                        break
                y, logprobs, queued = mx.array([token_i], dtype=mx.uint32), step_logprobs[-1], False
            if last is not None:
                _record(policy, *last, time.perf_counter() - t_last)
        finally:
            # Stopped inside a step: neither cache keeps a token past the last one yielded.
            keep = 1 + out  # the suffix's last token, then the tokens yielded
            if (layer_offset(layers) or 0) > base + keep:
                trim_layers(layers, base + keep)
            drafter.rewind(keep)


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


__all__ = ["Drafter", "LocalSource", "lookup_drafter", "model_drafter", "prefill", "speculative_tokens",
           "standard_tokens", "with_context"]
