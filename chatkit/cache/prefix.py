"""KV of prompt prefixes shared between sessions: a session that starts from an empty cache copies the
KV of the longest prefix of its prompt that another session already prefilled, instead of computing it.

The store is mlx-lm's ``LRUPromptCache`` (the one its server uses: a token trie, longest-prefix search,
trimming a longer entry down to the shared part, an LRU byte budget). Entries are copies with their own
buffers, and every fetch is a copy again, so no session ever writes into another's arrays.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, LRUPromptCache

from ..errors import InvalidParamsError

_MODEL = "model"  # one store per model: the trie's model key is a constant


class PrefixCache:
    """Prompt prefixes of one model and their KV (plain ``KVCache`` layers), at most ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise InvalidParamsError(f"max_bytes={max_bytes!r}: must be an int >= 0.")
        self.max_bytes = max_bytes
        self._store = LRUPromptCache(max_size=sys.maxsize, max_bytes=max_bytes)
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes the stored prefixes hold."""
        return int(self._store.nbytes)

    def __len__(self) -> int:
        return len(self._store)

    def fetch(self, prompt: Sequence[int]) -> tuple[int, list[Any]] | None:
        """The longest stored prefix of ``prompt`` that leaves at least one token to feed: (its length,
        a copy of its layers); ``None`` when nothing is shared."""
        if len(prompt) < 2:
            return None
        with self._lock:
            layers, rest = self._store.fetch_nearest_cache(_MODEL, list(prompt))
        if layers is None:
            return None
        n = len(prompt) - len(rest)
        if n == len(prompt):  # the whole prompt: give back one token, so that it produces logits
            for c in layers:
                c.trim(1)
            n -= 1
        if n <= 0 or any(c.offset != n for c in layers):
            return None
        mx.eval([c.state for c in layers])
        return n, layers

    def insert(self, tokens: Sequence[int], layers: Sequence[Any]) -> None:
        """Remember the KV of ``tokens``: the first ``len(tokens)`` positions of ``layers`` (copied)."""
        n = len(tokens)
        if n < 2 or not layers or not all(type(c) is KVCache and c.offset >= n for c in layers):
            return
        copies = [_copy(c, n) for c in layers]
        if sum(c.nbytes for c in copies) > self.max_bytes:
            return  # would evict everything and not fit itself
        mx.eval([c.state for c in copies])
        with self._lock:
            self._store.insert_cache(_MODEL, list(tokens), copies)


def _copy(layer: KVCache, n: int) -> KVCache:
    """The first ``n`` positions of ``layer`` in buffers of their own (the exact size, not mlx-lm's
    256-step growth; never a view of the session's buffers)."""
    assert layer.keys is not None and layer.values is not None
    copy = KVCache()
    copy.keys = layer.keys[..., :n, :] + 0
    copy.values = layer.values[..., :n, :] + 0
    copy.offset = n
    return copy


__all__ = ["PrefixCache"]
