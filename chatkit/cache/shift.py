"""Context shift: dropping a span of tokens from inside a KV cache, without a re-prefill.

The keys a rotary-embedding model caches are rotated by their position; rotations add, so the keys
after a dropped span of ``delta`` tokens are moved to their new positions by a rotation of ``-delta``
(llama.cpp's context shift). Values carry no position. The result is inexact by nature: the kept keys
and values were computed attending to the dropped tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ..model.rope import Rope, layer_ropes
from ._mlx import kv_arrays, kv_layer, make_prompt_cache
from .planner import common_prefix_length


def rotate(keys: mx.array, rope: Rope, delta: int) -> mx.array:
    """``keys`` (batch, heads, tokens, width), rotated as if each were ``delta`` positions earlier."""
    b, h, t, d = keys.shape
    one = keys.reshape(b, h * t, 1, d)  # every key its own sequence of one: one angle for all
    moved = mx.fast.rope(one, rope.dims, traditional=rope.traditional, base=rope.base, scale=rope.scale,
                         offset=-delta, freqs=rope.freqs)
    return moved.reshape(b, h, t, d)


def cut(keys: mx.array, values: mx.array, start: int, delta: int, rope: Rope) -> tuple[mx.array, mx.array]:
    """The keys and values without positions ``start`` to ``start + delta``, the later keys re-rotated."""
    kept_keys = [keys[..., :start, :], rotate(keys[..., start + delta :, :], rope, delta)]
    kept_values = [values[..., :start, :], values[..., start + delta :, :]]
    return mx.concatenate(kept_keys, axis=2), mx.concatenate(kept_values, axis=2)


def shift_layers(layers: Sequence[Any], ropes: Sequence[Rope], start: int, delta: int) -> list[Any] | None:
    """New layers without positions ``start`` to ``start + delta`` (each layer re-rotated by its own
    rotation); ``None`` when a layer is not a plain KV cache holding them all (nothing changes)."""
    if len(layers) != len(ropes) or delta <= 0 or start < 0:
        return None
    arrays = [kv_arrays(c) for c in layers]
    if any(a is None or a[2] < start + delta for a in arrays):
        return None
    shifted = []
    for (keys, values, _), rope in zip(arrays, ropes):  # type: ignore[misc]
        shifted.append(kv_layer(*cut(keys, values, start, delta, rope)))
    mx.eval([c.state for c in shifted])
    return shifted


def plan_shift(held: Sequence[int], prompt: Sequence[int], delta: int) -> int | None:
    """Where a shift of ``delta`` tokens starts in the ``held`` ids so that what is left renders as
    ``prompt`` does (its common prefix with ``prompt`` grows past the cut): the end of ``held``'s common
    prefix with ``prompt``; ``None`` when no such shift helps (the template renders the kept context
    differently: the turn re-prefills instead)."""
    start = common_prefix_length(held, prompt)
    if delta <= 0 or start + delta >= len(held):
        return None
    kept = [*held[:start], *held[start + delta :]]
    return start if common_prefix_length(kept, prompt) > start else None


def shift_problem(model: Any) -> list[Rope] | str:
    """Each cache layer's rotation if ``model``'s cache can shift, else why not."""
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model) if kv_arrays(c) is None and not _plain(c)})
    if kinds:
        why = {"RotatingKVCache": "sliding-window layers (RotatingKVCache)", "ArraysCache": "recurrent state (ArraysCache)"}
        return "its cache has " + ", ".join(why.get(k, k) for k in kinds) + ", which cannot drop tokens from inside"
    ropes = layer_ropes(model)
    return ropes if isinstance(ropes, str) or len(ropes) == len(make_prompt_cache(model)) else \
        "its cache layers do not match its decoder layers"


def _plain(layer: Any) -> bool:
    return type(layer).__name__ == "KVCache"


__all__ = ["cut", "plan_shift", "rotate", "shift_layers", "shift_problem"]
