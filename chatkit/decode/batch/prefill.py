"""The joining turns of a ``BatchEngine``: their prompts prefilled together, one right-padded forward
pass per chunk (as mlx-lm's ``BatchGenerator`` does), before they join the decode batch.

The turns' caches are moved into ``BatchKVCache`` layers when the group starts (the sessions let go of
them: one copy), with room for the whole prompts (growing a buffer mid-pass would copy every layer's
at once). Each chunk feeds every turn the next tokens of its prompt but the last, right-padded to
the longest; ``finalize`` then rolls each row's padding to its left, so that every row ends at the
write position. The prompts' last tokens are fed by the decode batch's next step, with the others'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ...cache._mlx import batch_layer
from .job import Job


class Prefill:
    """Turns prefilling together (see the module docstring); empty between groups."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.jobs: list[Job] = []
        self.layers: list[Any] = []

    def __len__(self) -> int:
        return len(self.jobs)

    def start(self, jobs: list[Job]) -> None:
        """A new group: ``jobs``' caches moved into batched layers (each job's list is emptied), layer
        by layer so that no cache is ever held twice whole."""
        self.jobs, self.layers = list(jobs), []
        moved = [list(job.layers) for job in jobs]
        for job in jobs:
            job.layers.clear()
        ahead = max(len(job.suffix) for job in jobs) + 1  # the prompts, and the batch's first step
        for i in range(len(moved[0])):
            layer = batch_layer(None, [m[i] for m in moved], ahead)
            for m in moved:
                m[i] = None
            mx.eval(layer.state)
            self.layers.append(layer)

    @property
    def done(self) -> bool:
        return all(job.prefill_done for job in self.jobs)

    def feed(self, budget: int) -> int:
        """Feed each turn its next chunk of the prompt (at most ``budget`` tokens in all, and at most
        each turn's own ``step`` per row); tokens fed, padding included."""
        width = max(1, min(min(job.step for job in self.jobs), budget // len(self.jobs)))
        chunks = [job.suffix[job.prefilled : min(job.prefilled + width, len(job.suffix) - 1)] for job in self.jobs]
        width = max(len(c) for c in chunks)
        if width == 0:
            return 0
        pads = [width - len(c) for c in chunks]
        inputs = mx.array([list(c) + [0] * p for c, p in zip(chunks, pads)], dtype=mx.uint32)
        for c in self.layers:
            c.prepare(right_padding=pads)
        self.model(inputs, cache=self.layers)
        mx.eval([c.state for c in self.layers])
        for c in self.layers:  # one layer at a time: a roll copies the layer's buffer
            c.finalize()
            mx.eval(c.state)
        for job, chunk in zip(self.jobs, chunks):
            job.prefilled += len(chunk)
            if chunk:
                job.progress(job.prefilled)
        return width * len(chunks)

    def leave(self, idx: Sequence[int]) -> list[list[Any]]:
        """Turns ``idx`` leave the group (cancelled, or the group failed); their caches, in order."""
        gone = set(idx)
        keep = [i for i in range(len(self.jobs)) if i not in gone]
        caches: list[list[Any]] = [[KVCache() if c.keys is None else c.extract(i) for c in self.layers] for i in idx]
        mx.eval([c.state for cache in caches for c in cache])
        if keep:
            for c in self.layers:
                c.filter(keep)
        self.jobs = [self.jobs[i] for i in keep]
        if not keep:
            self.layers = []
        return caches

    def take(self) -> tuple[list[Job], list[Any]]:
        """The group's turns and layers, to join the decode batch; the group is empty again."""
        jobs, layers = self.jobs, self.layers
        self.jobs, self.layers = [], []
        return jobs, layers


__all__ = ["Prefill"]
