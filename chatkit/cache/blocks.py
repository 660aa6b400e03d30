"""KV blocks of the prompt cache: their keys (a hash chain), taking them out of a session's layers and
putting them together again.

A block holds the KV of ``block_tokens`` consecutive positions of every layer. Its key hashes the key of
the block before it, its own token ids and the images that fill any of them, starting from a seed that
names everything else that shapes the KV (the model, the adapter and its scale, the KV quantization): two
blocks have the same key only when everything before and in them is the same.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ..images import ImageSpan

PLAIN, QUANTIZED = "KVCache", "QuantizedKVCache"


def seed_of(parts: Mapping[str, Any]) -> str:
    """The seed of a chain: a digest of what shapes the KV besides the tokens (JSON, keys sorted)."""
    text = json.dumps(parts, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def in_block(images: Sequence[ImageSpan], start: int, end: int) -> list[ImageSpan]:
    """The images that fill some of the positions ``[start, end)``."""
    return [span for span in images if span.start < end and span.end > start]


def chain(seed: str, tokens: Sequence[int], images: Sequence[ImageSpan], block: int) -> Iterator[str]:
    """The keys of the full blocks of ``tokens``, first to last (lazily: a lookup stops at a miss)."""
    previous = seed.encode("ascii")
    for start in range(0, len(tokens) - block + 1, block):
        end = start + block
        h = hashlib.blake2b(previous, digest_size=20)
        h.update(array("q", tokens[start:end]).tobytes())
        for span in in_block(images, start, end):  # an image in this block: its pixels shape the KV
            h.update(json.dumps([span.start, span.end, span.digest, list(span.layout)]).encode("utf-8"))
        previous = h.hexdigest().encode("ascii")
        yield previous.decode("ascii")


def tail_key(parent: str, ids: Sequence[int]) -> str:
    """The key of a partial block (fewer tokens than a block) after ``parent``: reached only as the block
    that follows ``parent`` and starts like a prompt's rest, never by the chain."""
    h = hashlib.blake2b(parent.encode("ascii") + b"|tail|", digest_size=20)
    h.update(array("q", ids).tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class Block:
    """One block: per layer its arrays (keys then values; a quantized layer's are 3 each), the token
    axis second to last; ``kind`` the layers' class, ``bits``/``group`` a quantized one's; ``ids`` its
    token ids and ``images`` whether an image fills some of them (a block is only taken in part when
    none does)."""

    kind: str
    layers: tuple[tuple[mx.array, ...], ...]
    tokens: int
    bits: int = 0
    group: int = 0
    ids: tuple[int, ...] = ()
    images: bool = False

    def head(self, n: int) -> Block:
        """The first ``n`` positions (views: ``join`` copies them)."""
        layers = tuple(tuple(a[..., :n, :] for a in arrays) for arrays in self.layers)
        return Block(self.kind, layers, n, self.bits, self.group, self.ids[:n], self.images)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for arrays in self.layers for a in arrays)


def kind_of(layers: Sequence[Any]) -> str | None:
    """The one kind of cache layer a block can be made of (every layer plain or every layer quantized
    alike); ``None`` for anything else (rotating windows, recurrent states, a mix)."""
    if layers and all(type(c) is KVCache for c in layers):
        return PLAIN
    if layers and all(type(c) is QuantizedKVCache for c in layers):
        first = layers[0]
        if all((c.bits, c.group_size) == (first.bits, first.group_size) for c in layers):
            return QUANTIZED
    return None


def take(layers: Sequence[Any], start: int, end: int, ids: Sequence[int] = (), images: bool = False) -> Block:
    """Positions ``[start, end)`` of ``layers`` as a block in buffers of its own (never a view: the
    session writes into its buffers again after a rewind)."""
    kind = kind_of(layers)
    assert kind is not None
    out = []
    for c in layers:
        parts = (*c.keys, *c.values) if kind == QUANTIZED else (c.keys, c.values)
        out.append(tuple(a[..., start:end, :] + 0 for a in parts))
    mx.eval([a for arrays in out for a in arrays])
    first = layers[0]
    bits, group = (first.bits, first.group_size) if kind == QUANTIZED else (0, 0)
    return Block(kind, tuple(out), end - start, bits, group, tuple(ids), images)


def join(blocks: Sequence[Block]) -> list[Any]:
    """Cache layers holding ``blocks`` one after the other (new arrays: nothing shared with the blocks)."""
    first = blocks[0]
    n = sum(b.tokens for b in blocks)
    layers: list[Any] = []
    for i in range(len(first.layers)):
        parts = [_joined([b.layers[i][j] for b in blocks], room=first.kind == PLAIN) for j in range(len(first.layers[i]))]
        if first.kind == QUANTIZED:
            c: Any = QuantizedKVCache(group_size=first.group, bits=first.bits)
            c.keys, c.values = tuple(parts[:3]), tuple(parts[3:])
        else:
            c = KVCache()
            c.keys, c.values = parts
        c.offset = n
        layers.append(c)
    mx.eval([c.state for c in layers])
    return layers


def _joined(arrays: Sequence[mx.array], room: bool) -> mx.array:
    """``arrays`` one after the other on the token axis, in a new buffer. ``room``: the buffer ends at
    the next multiple of mlx-lm's ``KVCache.step`` (256) after the last token, as a prefilled cache's does,
    so the turn's first new tokens are written in place instead of copying the whole cache again."""
    first = arrays[0]
    if room:
        spare = KVCache.step - sum(a.shape[-2] for a in arrays) % KVCache.step
        arrays = [*arrays, mx.zeros((*first.shape[:-2], spare, first.shape[-1]), first.dtype)]
    if len(arrays) == 1:
        return first + 0
    if mx.default_device() == mx.cpu and first.dtype != mx.bfloat16:
        # MLX's CPU concatenate runs at half numpy's speed here (13.6 vs 6.4 ms for a 2k-token cache of
        # the bench model, both copies included); on Metal MLX's runs on the GPU.
        return mx.array(np.concatenate([np.asarray(a) for a in arrays], axis=-2))
    return mx.concatenate(list(arrays), axis=-2)


def fits(block: Block, like: Block) -> bool:
    """Whether ``block`` can follow ``like`` (same kind, layers, arrays and shapes but the token axis)."""
    if (block.kind, block.bits, block.group, len(block.layers)) != (like.kind, like.bits, like.group, len(like.layers)):
        return False
    for mine, theirs in zip(block.layers, like.layers):
        if len(mine) != len(theirs):
            return False
        for a, b in zip(mine, theirs):
            if a.dtype != b.dtype or a.ndim != b.ndim or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-1]:
                return False
    return True


__all__ = ["PLAIN", "QUANTIZED", "Block", "chain", "fits", "in_block", "join", "kind_of", "seed_of", "tail_key", "take"]
