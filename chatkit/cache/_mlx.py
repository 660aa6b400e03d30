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
    ArraysCache,
    BatchKVCache,
    ChunkedKVCache,
    ConcatenateKVCache,
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
    "batch_layer",
    "can_trim",
    "copy_layer",
    "cut_to_offset",
    "eval_layers",
    "fixed_shapes",
    "held_tokens",
    "kinds_that_cannot_rewind",
    "kv_arrays",
    "kv_layer",
    "layer_offset",
    "load_prompt_cache",
    "make_prompt_cache",
    "same_kind",
    "save_prompt_cache",
    "speculation_room",
    "state_problem",
    "trim_layers",
    "window_of",
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


def kv_arrays(layer: Any) -> tuple[mx.array, mx.array, int] | None:
    """A plain KV layer's (keys, values, offset), cut to the tokens it holds; ``None`` for other layers
    (quantized, rotating, recurrent) or an empty one."""
    if type(layer) is not KVCache or layer.keys is None:
        return None
    n = layer.offset
    return layer.keys[..., :n, :], layer.values[..., :n, :], n


def kv_layer(keys: mx.array, values: mx.array) -> Any:
    """A plain KV layer holding ``keys`` and ``values`` (every position of them)."""
    return KVCache.from_state((keys, values, int(keys.shape[2])))


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


# -- the state of a layer read from a file --------------------------------------------------------------
# A file can be forged with valid checksums; mlx-lm trusts every field of a layer's state, and fails
# mid-turn (or writes past its buffers) when one disagrees with the tensors. These checks read only
# types, shapes and the fields mlx-lm sets, and follow how its classes fill their buffers.
_FLOATS = frozenset({mx.float16, mx.bfloat16, mx.float32})
_BITS, _GROUPS = (2, 3, 4, 5, 6, 8), (32, 64, 128)


def state_problem(layer: Any) -> str | None:
    """What in a loaded layer's own state cannot be (a field of the wrong type or out of range for its
    tensors, buffers not shaped as one sequence's), as words after the layer's name; ``None`` if nothing."""
    check = _STATE_CHECKS.get(type(layer))
    if check is None:
        return "is of a class chatkit does not restore"
    return check(layer)


def window_of(layer: Any) -> tuple[int, int] | None:
    """A rotating layer's (window size, tokens kept at the start); ``None`` for other layers."""
    return (layer.max_size, layer.keep) if isinstance(layer, RotatingKVCache) else None


def _not_ints(layer: Any, *names: str) -> str | None:
    for name in names:
        value = getattr(layer, name, None)
        if not isinstance(value, int) or isinstance(value, bool):
            return f"has {name} {_shown(value)}, not an int"
    return None


def _shown(value: Any) -> str:
    text = f"{type(value).__name__} {tuple(value.shape)}" if isinstance(value, mx.array) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _buffers(keys: Any, values: Any) -> str | None:
    """Attention buffers: none, or float keys and values of one sequence, (1, heads, tokens, width)."""
    if keys is None and values is None:
        return None
    if not (isinstance(keys, mx.array) and isinstance(values, mx.array)):
        return f"holds keys {_shown(keys)} and values {_shown(values)}, not arrays"
    if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3] or keys.shape[0] != 1:
        return f"holds keys {tuple(keys.shape)} and values {tuple(values.shape)}, not one sequence's buffers"
    if keys.dtype not in _FLOATS or values.dtype not in _FLOATS:
        return f"holds keys of dtype {keys.dtype} and values of dtype {values.dtype}, not floats"
    return None


def _held(keys: Any) -> int:
    return 0 if keys is None else int(keys.shape[2])


def _kv_state(c: KVCache) -> str | None:
    problem = _buffers(c.keys, c.values) or _not_ints(c, "offset")
    if problem is None and not 0 <= c.offset <= _held(c.keys):
        problem = f"counts {c.offset} tokens in buffers of {_held(c.keys)}"
    return problem


def _quantized_state(c: QuantizedKVCache) -> str | None:
    problem = _not_ints(c, "offset", "group_size", "bits")
    if problem is None and (c.bits not in _BITS or c.group_size not in _GROUPS):
        problem = f"is quantized with bits={c.bits}, group_size={c.group_size}, which MLX does not take"
    if problem is not None or (c.keys is None and c.values is None and c.offset == 0):
        return problem
    parts: list[Any] = [c.keys, c.values]
    if not all(isinstance(p, (list, tuple)) and len(p) == 3 and all(isinstance(a, mx.array) and a.ndim == 4 for a in p)
               for p in parts):
        return "holds quantized keys or values that are not (packed, scales, biases) arrays"
    rows = parts[0][0].shape[:3]
    for packed, scales, biases in parts:
        if (packed.dtype != mx.uint32 or scales.dtype not in _FLOATS or biases.dtype != scales.dtype
                or packed.shape[:3] != rows or scales.shape != biases.shape or scales.shape[:3] != rows
                or rows[0] != 1 or packed.shape[-1] * 32 != scales.shape[-1] * c.group_size * c.bits):
            return f"holds quantized buffers that do not fit bits={c.bits} and group_size={c.group_size}"
    if not 0 <= c.offset <= rows[2]:
        return f"counts {c.offset} tokens in buffers of {rows[2]}"
    return None


def _rotating_state(c: RotatingKVCache) -> str | None:
    problem = _buffers(c.keys, c.values) or _not_ints(c, "offset", "keep", "max_size", "_idx")
    if problem is not None:
        return problem
    held, size = _held(c.keys), c.max_size
    if not 0 <= c.keep < size:
        return f"keeps {c.keep} tokens of a window of {size}"
    if c.offset < size:  # not full yet: the buffer is in order and written up to offset
        fits = c._idx == c.offset <= held <= size
    else:  # full: a ring of the window's size (written up to _idx), or just after a multi-token step
        fits = (held == size and c.keep <= c._idx <= held) or (held > size and c._idx == held)
    return None if fits else (
        f"has offset {c.offset}, write position {c._idx} and a buffer of {held} tokens, which a window "
        f"of {size} keeping {c.keep} cannot hold"
    )


def _arrays_state(c: ArraysCache) -> str | None:
    if c.left_padding is not None or c.lengths is not None:
        return "holds a batch's padding, not one conversation's state"
    # Any dtype: some models keep token ids there (mlx-lm's n-gram caches); the shapes are checked
    # against the model's (``layers_fit``).
    if not isinstance(c.cache, list) or not all(
        a is None or (isinstance(a, mx.array) and a.ndim >= 1 and a.shape[0] == 1) for a in c.cache
    ):
        return "holds states that are not one sequence's arrays"
    return None


def _chunked_state(c: ChunkedKVCache) -> str | None:
    problem = _buffers(c.keys, c.values) or _not_ints(c, "offset", "chunk_size", "start_position")
    if problem is None and not (c.chunk_size >= 1 and 0 <= c.start_position <= c.offset
                                and c.offset - c.start_position <= _held(c.keys)):
        problem = (f"has offset {c.offset}, start {c.start_position} and chunk size {c.chunk_size}, "
                   f"which its buffers of {_held(c.keys)} tokens cannot hold")
    return problem


_STATE_CHECKS: dict[type, Any] = {
    KVCache: _kv_state,
    QuantizedKVCache: _quantized_state,
    RotatingKVCache: _rotating_state,
    ArraysCache: _arrays_state,
    ChunkedKVCache: _chunked_state,
    ConcatenateKVCache: lambda c: _buffers(c.keys, c.values),
}


def batch_layer(batch: Any, news: list[Any], ahead: int = 1) -> Any:
    """One ``BatchKVCache`` layer holding ``batch``'s rows (or none) and then those of ``news`` (plain
    ``KVCache`` layers, one row each, maybe empty, or ``BatchKVCache`` layers), right-aligned, written
    into one new buffer (mlx-lm's ``merge`` then ``extend`` would copy the batch twice), with room for
    at least ``ahead`` more positions (in ``BatchKVCache.step`` steps): a forward pass that outgrows
    the buffer copies every layer's at once."""
    parts = ([] if batch is None else [batch]) + list(news)
    held = [c.size() if isinstance(c, BatchKVCache) else c.offset for c in parts]
    pads: list[list[int]] = [c.left_padding.tolist() if isinstance(c, BatchKVCache) else [0]  # type: ignore[misc]
                             for c in parts]
    width = max(held)
    left = [p + width - n for n, part in zip(held, pads) for p in part]
    ref = next((c for c in parts if c.keys is not None), None)
    if ref is None or width == 0:  # nothing cached in any row yet: the first step allocates
        return BatchKVCache([0] * len(left))
    H = ref.keys.shape[1]
    room = -(-(width + max(1, ahead)) // BatchKVCache.step) * BatchKVCache.step
    keys = mx.zeros((len(left), H, room, ref.keys.shape[3]), ref.keys.dtype)
    values = mx.zeros((len(left), H, room, ref.values.shape[3]), ref.values.dtype)
    row = 0
    for c, n, part in zip(parts, held, pads):
        if n:
            keys[row : row + len(part), :, width - n : width] = c.keys[..., :n, :]
            values[row : row + len(part), :, width - n : width] = c.values[..., :n, :]
        row += len(part)
    layer = BatchKVCache(left)  # offsets: -left; each row then holds ``width - left`` tokens
    layer.keys, layer.values, layer._idx = keys, values, width  # type: ignore[assignment]
    layer.offset = layer.offset + width
    return layer
