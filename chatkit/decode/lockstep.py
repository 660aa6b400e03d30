"""The lockstep token source: a sharded model's turn decoded on every rank together (see
``chatkit.distributed`` for the rules that keep the ranks in step)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import mlx.core as mx

from ..cache.state import CacheState
from ..distributed import Group, all_gather_ints, all_sum_ints, digest_ints, guarded
from ..errors import DistributedError
from . import Request, TokenEvent
from .local import standard_tokens, with_context


class DistributedSource:
    """Tokens of a sharded model, every rank in lockstep with rank 0 (see the module docstring).

    Speculative decoding is not offered over a sharded model (the draft would run unsharded on
    every rank and accept different runs).
    """

    num_draft_tokens = 0

    def __init__(self, model: Any, group: Group) -> None:
        self.model = model
        self.group = group

    def generate(self, cache: CacheState, request: Request) -> Iterator[TokenEvent]:
        assert cache.layers is not None, "prepare the cache before generating"
        processors = with_context(request.logits_processors, request.context)
        watchdog = self.group.watchdog
        progress = request.progress

        def on_progress(done: int, total: int) -> None:
            watchdog.kick()  # a finished prefill chunk: the ranks are moving together
            if progress is not None:
                progress(done, total)

        lockstep_request = replace(request, sampler=leader_sampler(self.group, request.sampler), progress=on_progress)
        return lockstep(self.group, request, standard_tokens(self.model, cache.layers, lockstep_request, processors))


def leader_sampler(group: Group, sampler: Callable[[mx.array], mx.array]) -> Callable[[mx.array], mx.array]:
    """``sampler`` on rank 0, its token sent to every rank inside the step's graph (no extra sync)."""
    lead = group.leader

    def sample(logprobs: mx.array) -> mx.array:
        token = sampler(logprobs)
        mine = token.astype(mx.int32) if lead else mx.zeros(token.shape, dtype=mx.int32)
        return mx.distributed.all_sum(mine, group=group.group).astype(token.dtype)

    return sample


def lockstep(group: Group, request: Request, steps: Iterator[TokenEvent]) -> Iterator[TokenEvent]:
    """``steps`` with the turn checked and every stop voted on by all ranks (see the module docstring)."""
    try:
        with guarded(group, "starting a turn"):
            check_same_turn(group, request)
        while True:
            with guarded(group, "generating"):
                try:
                    token = next(steps)
                except StopIteration:
                    return
            try:
                yield token
            except GeneratorExit:  # this rank's stream stopped: tell the others
                with guarded(group, "stopping a reply"):
                    all_sum_ints(group, [1])
                raise
            with guarded(group, "generating"):
                if all_sum_ints(group, [0])[0]:
                    return  # another rank (rank 0's user) stopped here
    finally:
        close = getattr(steps, "close", None)  # a generator (standard_tokens): release mlx-lm's step
        if close is not None:
            close()


def check_same_turn(group: Group, request: Request) -> None:
    """``DistributedError`` unless every rank is about to run the same turn over the same cache."""
    mine = [*digest_ints(request.suffix), *digest_ints(request.context), int(request.max_tokens)]
    rows = all_gather_ints(group, mine)
    differ = [r for r, row in enumerate(rows) if row != rows[0]]
    if differ:
        raise DistributedError(
            f"rank(s) {', '.join(map(str, differ))} are not running the turn rank 0 runs (another prompt, "
            "history or cache): every rank must make the same session calls with the same inputs. "
            "Start the session again on all ranks.",
            rank=group.rank, peer=differ[0],
        )


__all__ = ["DistributedSource", "check_same_turn", "leader_sampler", "lockstep"]
