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
        drafting = self.speculative is not None and self.speculative.draft_model is not None
        if drafting or request.adapter is not None or request.vision is not None or not batchable(cache):
            return self.fallback.generate(cache, request)
        return self._tokens(cache, request)

    def _tokens(self, cache: CacheState, request: Request) -> Iterator[TokenEvent]:
        layers = cache.layers
        assert layers is not None
        base = layer_offset(layers) or 0
        policy = self.fallback.policy if self.speculative is not None else None
        if policy is not None:
            new_turn(policy)
        step = min(self.engine.prefill_step_size, request.options.prefill_step_size)
        job = Job(request.suffix, request.context, request.max_tokens, request.sampler,
                  tuple(request.logits_processors), layers, step, self.speculative, policy, request.drafts)
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
            if back is not None:
                # What the turn fed and read, no run-ahead; after a failure only the prompt: the turn
                # commits no reply, and the next one reuses what the cache holds of the prompt.
                target = base + len(request.suffix) + (0 if failed else read)
                trim_layers(back, target)
                layers[:] = back
            elif not layers:  # handed to the batch and not given back: rebuild next turn
                cache.reset()


def batchable(cache: CacheState) -> bool:
    """Whether a session's cache can join the batch: plain ``KVCache`` layers, no quantization."""
    options = cache.options
    return (
        cache.layers is not None
        and options.kv_bits is None
        and options.max_kv_size is None
        and cache.draft_layers is None
        and all(type(c) is KVCache for c in cache.layers)
    )


__all__ = ["BatchSource", "Engine", "batchable"]
