"""A session's token source over a ``BatchEngine``, and the checks of what can join the batch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from mlx_lm.models.cache import KVCache

from ...cache._mlx import layer_offset, trim_layers
from ...cache.state import CacheState
from .. import Request, TokenEvent
from ..local import LocalSource
from ..speculative import SpeculativeConfig
from ..speculative.policy import new_turn
from .job import End, Job, Progress


class Engine(Protocol):
    """What a :class:`BatchSource` needs of its ``BatchEngine``."""

    prefill_step_size: int

    def check_open(self) -> None:
        """Raise if the engine is closed (before a turn is handed to it)."""
        ...

    def submit(self, job: Job) -> None:
        """Take ``job`` into the batch; its events arrive on ``job.out``."""
        ...

    def release(self, job: Job) -> list[Any] | None:
        """Take ``job`` out of the batch and give its cache back (``None``: none to give)."""
        ...


class BatchSource:
    """A session's token source over a :class:`BatchEngine` (``fallback``: the session's local source,
    for turns that run alone; see the package docstring)."""

    def __init__(self, engine: Engine, fallback: LocalSource, speculative: SpeculativeConfig | None) -> None:
        self.engine, self.fallback, self.speculative = engine, fallback, speculative

    def generate(self, cache: CacheState, request: Request) -> Iterator[TokenEvent]:
        self.engine.check_open()
        assert cache.layers is not None, "prepare the cache before generating"
        if request.adapter is not None or request.vision is not None or not batchable(cache):
            return self.fallback.generate(cache, request)
        return self._tokens(cache, request)

    def _tokens(self, cache: CacheState, request: Request) -> Iterator[TokenEvent]:
        layers, drafts = cache.layers, cache.draft_layers
        assert layers is not None
        base, draft_base = layer_offset(layers) or 0, layer_offset(drafts or []) or 0
        policy = self.fallback.policy if self.speculative is not None else None
        if policy is not None:
            new_turn(policy)
        step = min(self.engine.prefill_step_size, request.options.prefill_step_size)
        model = self.speculative.draft_model if self.speculative is not None else None
        job = Job(request.suffix, request.context, request.max_tokens, request.sampler,
                  tuple(request.logits_processors), layers, step, None if model else self.speculative, policy,
                  request.drafts, draft=model.model if model else None, draft_layers=drafts if model else None)
        progress: Callable[[int, int], None] | None = request.progress
        read, failed = 0, False
        if progress is not None:
            progress(0, len(request.suffix))
        self.engine.submit(job)
        try:
            while True:
                event = job.out.get()
                if isinstance(event, TokenEvent):
                    read += 1
                    yield event
                elif isinstance(event, Progress):
                    if progress is not None:
                        progress(event.done, event.total)
                elif isinstance(event, End):
                    failed = event.error is not None
                    if event.error is not None:
                        raise event.error
                    return
        finally:
            back = self.engine.release(job)
            draft_back, job.draft_back = job.draft_back, None
            # What the turn fed and read, no run-ahead; after a failure only the prompt: the turn
            # commits no reply, and the next one reuses what the cache holds of the prompt.
            fed = len(request.suffix) + (0 if failed else read)
            if back is not None:
                trim_layers(back, base + fed)
                layers[:] = back
            if draft_back is not None and drafts is not None:  # a prefix of the target's: at most as long
                trim_layers(draft_back, min(layer_offset(draft_back) or 0, draft_base + fed))
                drafts[:] = draft_back
            if not layers or (drafts is not None and not drafts):  # handed to the batch, not given back
                cache.reset()  # rebuild next turn


def batchable(cache: CacheState) -> bool:
    """Whether a session's cache can join the batch: plain ``KVCache`` layers (a draft model's too), no
    quantization."""
    options = cache.options
    return (
        cache.layers is not None
        and options.kv_bits is None
        and options.max_kv_size is None
        and all(type(c) is KVCache for c in [*cache.layers, *(cache.draft_layers or [])])
    )


__all__ = ["BatchSource", "Engine", "batchable"]
