"""What proposes tokens to the speculative loop: a draft model, or prompt lookup."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import mlx.core as mx

from ...cache._mlx import layer_offset, trim_layers
from ...params import LogitsProcessor
from .lookup import NgramIndex


class Drafter(Protocol):
    """Proposes tokens for the speculative loop (:mod:`chatkit.decode.speculative.loop`).

    ``held`` is always the list of tokens fed to the target in this call after its prefill.
    """

    def catch_up(self, held: list[int]) -> None:
        """Take in ``held`` (a draft model feeds those it has not seen, e.g. after plain steps)."""
        ...

    def propose(self, y: mx.array, k: int, held: list[int]) -> mx.array:
        """Up to ``k`` tokens to follow ``held`` and ``y`` (the next token, not fed yet), maybe lazy."""
        ...

    def rewind(self, n: int) -> None:
        """Only the first ``n`` tokens of ``held`` stand (drafts were rejected)."""
        ...


class ModelDrafter:
    """Drafts with ``draft_model``, whose layers will hold what the target's hold once ``prefix``
    (the suffix but its last token) is prefilled into both.

    Drafts are greedy whatever the sampler: a draft only has to be likely, and drawing no random
    numbers keeps a seeded turn's draws those of standard decoding. Logits processors (a penalty, a
    grammar) shape the draft as they shape the target, so that the two agree more often.
    """

    def __init__(self, draft_model: Any, draft_layers: list[Any], processors: Sequence[LogitsProcessor],
                 prefix: Sequence[int]) -> None:
        self.model, self.layers, self.processors, self.prefix = draft_model, draft_layers, processors, prefix
        self.base = (layer_offset(draft_layers) or 0) + len(prefix)
        self.fed = 0  # tokens of ``held`` (or drafts past it) in the draft's cache

    def catch_up(self, held: list[int]) -> None:
        lag = held[self.fed:]  # the tokens decoded without drafting since the draft last ran
        if lag:
            self.model(mx.array(lag, dtype=mx.uint32)[None], cache=self.layers)
            mx.eval([c.state for c in self.layers])
            self.fed = len(held)

    def propose(self, y: mx.array, k: int, held: list[int]) -> mx.array:
        lag = held[self.fed:]
        inp = mx.concatenate([mx.array(lag, dtype=mx.uint32), y]) if lag else y
        processors = self.processors
        shown = mx.array([*self.prefix, *held], dtype=mx.uint32) if processors else None
        drafts: list[mx.array] = []
        for _ in range(k):
            logits = self.model(inp[None], cache=self.layers)[:, -1, :]
            if shown is not None:
                seen = mx.concatenate([shown, y, *drafts])
                for processor in processors:
                    logits = processor(seen, logits)
            inp = mx.argmax(logits, axis=-1).astype(mx.uint32)
            mx.async_eval(inp)
            drafts.append(inp)
        self.fed = len(held) + k  # y and every draft but the last
        return mx.concatenate(drafts)

    def rewind(self, n: int) -> None:
        if self.fed > n:
            trim_layers(self.layers, self.base + n)
            self.fed = n


class LookupDrafter:
    """Drafts the continuation of the last n-gram's earlier occurrence. ``index`` holds the cached
    tokens and the first ``indexed`` tokens that ``held`` will hold (the suffix)."""

    def __init__(self, index: NgramIndex, indexed: int) -> None:
        self.index, self.done = index, indexed

    def catch_up(self, held: list[int]) -> None:
        self.index.extend(held[self.done:])
        self.done = len(held)

    def propose(self, y: mx.array, k: int, held: list[int]) -> mx.array:
        self.catch_up(held)
        self.index.extend([int(y.item())])  # type: ignore[arg-type]
        self.done += 1  # y is fed next
        return mx.array(self.index.propose(k), dtype=mx.uint32)

    def rewind(self, n: int) -> None:
        """Nothing to take back: the index holds no rejected drafts, and a turn builds its own."""


__all__ = ["Drafter", "LookupDrafter", "ModelDrafter"]
