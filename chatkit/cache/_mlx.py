"""Every contact chatkit has with the insides of mlx-lm's cache classes, in one place.

mlx-lm's cache objects are plain Python classes whose ``state`` tuples and private fields change
between releases. chatkit reads them only here; ``tests/test_mlx_contract.py`` checks each assumption
against the installed mlx-lm, so an upgrade that changes one fails loudly instead of corrupting caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)

# Layers that rewind exactly at any time: a checkpoint needs only their offset.
ALWAYS_TRIMMABLE = (KVCache, QuantizedKVCache)

__all__ = [
    "ALWAYS_TRIMMABLE",
    "can_trim",
    "copy_layer",
    "cut_to_offset",
    "eval_layers",
    "fixed_shapes",
    "held_tokens",
    "kinds_that_cannot_rewind",
    "layer_offset",
    "load_prompt_cache",
    "make_prompt_cache",
    "same_kind",
    "save_prompt_cache",
    "speculation_room",
    "trim_layers",
]


def layer_offset(layers: Sequence[Any]) -> int | None:
    """The one offset all attention layers agree on; ``None`` if they disagree or none has one."""
    offsets = {c.offset for c in layers if isinstance(getattr(c, "offset", None), int)}
    return offsets.pop() if len(offsets) == 1 else None


def can_trim(layers: Sequence[Any]) -> bool:
    """Whether every layer can rewind now (mlx-lm's own test)."""
    return bool(layers) and can_trim_prompt_cache(list(layers))


def trim_layers(layers: Sequence[Any], target: int) -> bool:
    """Rewind every layer to ``target`` tokens; ``False`` if a layer did not comply.

    mlx-lm's ``trim_prompt_cache`` trims every layer by one count; layers here may hold different
    counts (a draft that lags), so each is trimmed by its own excess.
    """
    for c in layers:
        excess = c.offset - target
        if excess > 0 and c.trim(excess) != excess:
            return False
    return all(c.offset == target for c in layers if isinstance(getattr(c, "offset", None), int))


def copy_layer(layer: Any) -> Any:
    """An independent copy of one cache layer (MLX arrays are values: no data is copied until one
    side writes)."""
    state = tree_map(lambda x: x[...] if isinstance(x, mx.array) else x, layer.state)
    return type(layer).from_state(state)


def eval_layers(layers: Sequence[Any]) -> None:
    """Materialize the layers' arrays (on this thread: the next turn may run on another one)."""
    mx.eval([c.state for c in layers])


def same_kind(got: Any, want: Any) -> bool:
    """Whether layer ``got`` can stand where the model makes ``want`` (a quantized KV for a KV)."""
    return type(got) is type(want) or (isinstance(want, KVCache) and isinstance(got, QuantizedKVCache))


def cut_to_offset(layer: Any) -> Any:
    """A copy of ``layer`` whose buffers end at the last cached token (mlx-lm grows them in steps of
    256 and its ``state`` returns the whole buffer), so a saved file holds no unused positions."""
    if isinstance(layer, (KVCache, QuantizedKVCache)) and layer.keys is not None:
        n = layer.offset

        def cut(x: mx.array) -> mx.array:
            return x[..., :n, :]

        if isinstance(layer, QuantizedKVCache):
            assert layer.values is not None
            keys, values = tuple(cut(x) for x in layer.keys), tuple(cut(x) for x in layer.values)
            return QuantizedKVCache.from_state((keys, values, n, layer.group_size, layer.bits))
        return KVCache.from_state((cut(layer.keys), cut(layer.values), n))
    if isinstance(layer, RotatingKVCache) and layer.keys is not None and layer.offset < layer.max_size:
        n = layer._idx  # not wrapped yet: the buffer is in order and ends at _idx
        state = (layer.keys[..., :n, :], layer.values[..., :n, :], layer.offset, layer.keep, layer.max_size, n)
        return RotatingKVCache.from_state(state)
    return layer


def fixed_shapes(layer: Any) -> list[Any] | None:
    """The shapes of a layer's arrays that do not depend on how many tokens it holds (``None``: empty)."""
    keys = getattr(layer, "keys", None)
    if isinstance(layer, QuantizedKVCache) and keys is not None:
        # Packed uint32 words of 32 // bits values: compare as the unquantized width.
        packed: tuple[Any, Any] = (layer.keys, layer.values)
        return [(*a[0].shape[:-2], a[0].shape[-1] * 32 // layer.bits) for a in packed]
    if isinstance(keys, mx.array):
        return [(*a.shape[:-2], a.shape[-1]) for a in (layer.keys, layer.values)]
    if hasattr(layer, "keys"):
        return None  # an attention layer that holds nothing yet
    flat: list[tuple[str, Any]] = tree_flatten(layer.state)  # type: ignore[assignment]
    return [(name, tuple(v.shape) if isinstance(v, mx.array) else v) for name, v in flat]


def kinds_that_cannot_rewind(model: Any) -> list[str]:
    """The cache classes of ``model`` that are not plain KV caches (hybrid or rotating layers)."""
    return sorted({type(c).__name__ for c in make_prompt_cache(model) if not isinstance(c, KVCache)})


def held_tokens(layer: Any) -> int | None:
    """How many positions a layer's buffers really hold (a rotating cache keeps at most its size);
    ``None`` for layers without an offset (recurrent state)."""
    offset = getattr(layer, "offset", None)
    if not isinstance(offset, int):
        return None
    if isinstance(layer, RotatingKVCache):
        return min(offset, layer.max_size)
    return offset


def speculation_room(layers: Sequence[Any], kv_bits: int | None, quantized_kv_start: int) -> int:
    """How many tokens past the next one a multi-token step may feed into ``layers`` and stay
    token-exact with one-token steps (mlx-lm's ``generate_step``): unbounded (a large int) for plain
    and quantized KV caches.

    A rotating cache behaves as a plain one only until it is full: a multi-token step then keeps
    another window than one-token steps (it may drop the ``keep`` tokens) and a full cache cannot
    take back rejected tokens, so the step must end within ``max_size``. A KV cache that will be
    quantized (``kv_bits``) switches after the step that reaches ``quantized_kv_start`` tokens; the
    tokens of one step see full-precision keys, so the step must end before that point, and before
    the token that reaches it (left to a one-token step, so that a reply stopped inside a step's
    accepted drafts leaves the cache unquantized exactly when standard decoding would).
    """
    room = 1 << 30
    for c in layers:
        offset = getattr(c, "offset", None)
        if not isinstance(offset, int):
            continue
        if isinstance(c, RotatingKVCache):
            room = min(room, c.max_size - 1 - offset)
        elif kv_bits is not None and isinstance(c, KVCache):
            room = min(room, quantized_kv_start - 2 - offset)
    return max(room, 0)
