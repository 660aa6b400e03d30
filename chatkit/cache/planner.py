"""Planning cache reuse for a new prompt: a pure function of the ledger, the prompt and what the cache can do."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from ..images import ImageSpan
from .ledger import Ledger


class Action(str, Enum):
    APPEND = "append"  # the prompt extends the ledger: feed the rest
    TRIM = "trim"  # rewind the cache to the common prefix, then feed the rest
    RESTORE = "restore"  # the cache cannot rewind: restore a checkpoint, then feed the rest
    REBUILD = "rebuild"  # nothing reusable: start from an empty cache


@dataclass(frozen=True)
class Plan:
    """What to do with the cache before feeding ``suffix``.

    ``keep`` is how many ledger tokens (after the opaque prefix) stay in the cache; for ``RESTORE`` it
    is the length of the checkpoint restored. ``suffix`` is never empty: mlx-lm needs one token to feed.
    """

    action: Action
    keep: int
    suffix: tuple[int, ...]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def same_images_until(held: Sequence[ImageSpan], wanted: Sequence[ImageSpan], keep: int) -> int:
    """``keep`` cut to the start of the first image (before it) that is not the same in ``held`` and
    ``wanted``: same tokens do not mean same pixels, as every image's placeholders are alike."""
    mine, theirs = set(held), set(wanted)
    for span in (*held, *wanted):
        if span.start < keep and not (span in mine and span in theirs):
            keep = span.start
    return keep


def plan(
    ledger: Ledger,
    prompt: Sequence[int],
    *,
    trimmable: bool,
    checkpoints: Sequence[int] = (),
    images: Sequence[ImageSpan] = (),
) -> Plan:
    """Choose the cheapest way to get the cache to hold ``prompt`` (minus its last token at least).

    ``prompt`` is the ids to follow the opaque prefix. ``trimmable`` says whether every cache layer can
    rewind. ``checkpoints`` are ledger lengths at which a snapshot of the cache exists. ``images`` are
    where the prompt's images are: cached tokens are reused only up to the first image that differs.
    """
    if not prompt:
        raise ValueError("plan() needs a non-empty prompt")
    prompt = tuple(prompt)
    # Keep at most len(prompt) - 1 so that at least one token is fed and produces logits.
    keep = min(common_prefix_length(ledger.tokens, prompt), len(prompt) - 1)
    keep = same_images_until(ledger.images, images, keep)
    if keep == len(ledger.tokens):
        return Plan(Action.APPEND, keep, prompt[keep:])
    if trimmable:
        return Plan(Action.TRIM, keep, prompt[keep:])
    usable = [c for c in checkpoints if c <= keep]
    if usable:
        best = max(usable)
        return Plan(Action.RESTORE, best, prompt[best:])
    return Plan(Action.REBUILD, 0, prompt)


__all__ = ["Action", "Plan", "common_prefix_length", "plan", "same_images_until"]
