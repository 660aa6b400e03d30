"""The prompt cache: KV blocks shared by every session of a process (and, with a folder, across
processes and restarts), keyed by content so that a new conversation starts from the longest prefix of
its prompt that any session already computed.

Blocks are ``block_tokens`` long and keyed by a hash chain (``blocks.chain``) seeded with everything
that shapes the KV besides the tokens; a lookup walks the prompt block by block through a dict, so it
costs O(prompt length / block) whatever the number of cached blocks. The RAM tier keeps blocks within
``ram_bytes``, least recently used evicted first; the disk tier (``block_files``) writes every new
block through to ``folder`` within ``disk_bytes``. Every block handed out is a copy.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidParamsError
from ..images import ImageSpan
from .block_files import BlockFiles
from .blocks import Block, chain, fits, in_block, join, kind_of, seed_of, tail_key, take
from .planner import common_prefix_length

BLOCK_TOKENS = 256
DEFAULT_DISK_BYTES = 10 * 2**30


def default_ram_bytes() -> int:
    """The default RAM budget: an eighth of the machine's memory, at most 2 GiB (a 2k-token prompt of an
    8B model with grouped-query attention is about 256 MiB of fp16 KV, so this keeps several)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 * 2**30
    return int(min(2 * 2**30, max(total // 8, 64 * 2**20)))


@dataclass(frozen=True)
class PromptCacheUsage:
    """What a prompt cache holds and how it served: bytes per tier, distinct ``blocks`` (RAM or disk),
    ``hits`` (blocks served), ``misses`` (lookups that stopped at a block not cached; at most one per
    lookup), ``ram_evictions`` and ``disk_evictions`` (blocks dropped for the budgets)."""

    ram_bytes: int
    disk_bytes: int
    blocks: int
    ram_blocks: int
    disk_blocks: int
    hits: int
    misses: int
    ram_evictions: int
    disk_evictions: int
    block_tokens: int

    @property
    def evictions(self) -> int:
        return self.ram_evictions + self.disk_evictions


def _size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidParamsError(f"{name}={value!r}: must be an int >= 0 (bytes; 0 turns that tier off).")
    return value


class PromptCache:
    """KV blocks shared by sessions: ``chatkit.PromptCache(folder=None, ram_bytes=..., disk_bytes=...)``.

    Give it to ``builder.prompt_cache(pc)``; every session gets its model's process-wide one by default.
    ``folder`` adds a disk tier that survives restarts (``disk_bytes`` bounds it). See docs/caching.md.
    """

    def __init__(self, folder: str | os.PathLike[str] | None = None, *, ram_bytes: int | None = None,
                 disk_bytes: int = DEFAULT_DISK_BYTES, block_tokens: int = BLOCK_TOKENS) -> None:
        self.ram_max = _size("ram_bytes", default_ram_bytes() if ram_bytes is None else ram_bytes)
        disk_max = _size("disk_bytes", disk_bytes)
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or not 1 <= block_tokens <= 65536:
            raise InvalidParamsError(f"block_tokens={block_tokens!r}: must be an int from 1 to 65536.")
        if folder is not None and not isinstance(folder, (str, os.PathLike)):
            raise InvalidParamsError(f"folder takes a path or None, got {type(folder).__name__}.")
        self.block_tokens = block_tokens
        self.folder = None if folder is None else Path(os.path.expanduser(os.fspath(folder)))
        self._disk = BlockFiles(self.folder, disk_max) if self.folder is not None and disk_max else None
        self._ram: OrderedDict[str, tuple[Block, str]] = OrderedDict()  # key -> (block, the key before it)
        self._children: dict[str, list[str]] = {}  # a key -> the keys in RAM of the blocks that follow it
        self._ram_bytes = 0
        self._lock = threading.RLock()
        self._hits = self._misses = self._ram_evictions = 0

    def __repr__(self) -> str:
        u = self.usage()
        return f"PromptCache(folder={self.folder!r}, ram {u.ram_bytes}/{self.ram_max} B, {u.blocks} blocks)"

    def usage(self) -> PromptCacheUsage:
        """Bytes, blocks and counters now."""
        with self._lock:
            disk = self._disk
            keys = set(self._ram) | set(disk.keys() if disk is not None else ())
            return PromptCacheUsage(
                self._ram_bytes, disk.nbytes if disk else 0, len(keys), len(self._ram), len(disk) if disk else 0,
                self._hits, self._misses, self._ram_evictions, disk.evictions if disk else 0, self.block_tokens)

    def clear(self) -> None:
        """Forget every block, in RAM and in the folder (the counters stay)."""
        with self._lock:
            self._ram.clear()
            self._children.clear()
            self._ram_bytes = 0
            if self._disk is not None:
                self._disk.clear()

    def bind(self, parts: Mapping[str, Any]) -> SharedPrefixes:
        """This cache for KV shaped by ``parts`` (model fingerprint, adapter, KV quantization...)."""
        return SharedPrefixes(self, seed_of({**parts, "block_tokens": self.block_tokens}))

    def lookup(self, seed: str, prompt: Sequence[int], images: Sequence[ImageSpan], have: int) -> tuple[int, list[Any]] | None:
        """The longest cached KV of a prefix of ``prompt`` that leaves at least one token to feed, when it is
        longer than ``have``: (its length, new cache layers holding it). Whole blocks first, then the part of
        a cached block that follows the last of them and starts like the rest of the prompt (token-exact)."""
        limit = len(prompt) - 1
        if limit <= have:
            return None
        with self._lock:
            full = limit // self.block_tokens
            whole = self._whole(seed, list(chain(seed, prompt[: full * self.block_tokens], images, self.block_tokens)))
            parent = whole[-1][0] if whole else seed
            found = [block for _, block in whole]
            self._misses += len(found) < full
            n = len(found) * self.block_tokens
            tail = self._tail(parent, seed, prompt[n:limit], images, n, found)
            if tail is not None:
                found.append(tail)
                n += tail.tokens
            if n <= have:
                return None
            self._hits += len(found)
        return n, join(found)

    def _whole(self, seed: str, keys: list[str]) -> list[tuple[str, Block]]:
        """The cached blocks of ``keys`` (a chain) in order, up to the first missing one or one that does
        not fit the first; those only on disk are read together (``BlockFiles.read_many``) and kept in RAM."""
        present = []
        for key, parent in zip(keys, [seed, *keys[:-1]]):
            if key not in self._ram and (self._disk is None or not self._disk.has(key, parent)):
                break
            present.append((key, parent))
        on_disk = [key for key, _ in present if key not in self._ram]
        read = dict(zip(on_disk, self._disk.read_many(on_disk, seed, self.block_tokens))) if self._disk and on_disk else {}
        found: list[tuple[str, Block]] = []
        for key, parent in present:
            block = read.get(key) if key in on_disk else self._get(key, parent, seed)
            if block is None or (found and not fits(block, found[0][1])):
                break
            if key in on_disk:
                self._keep(key, parent, block)
            found.append((key, block))
        return found

    def _tail(self, parent: str, seed: str, rest: Sequence[int], images: Sequence[ImageSpan], at: int,
              found: list[Block]) -> Block | None:
        """The longest head of a cached block that follows ``parent`` and starts like ``rest`` (none where
        an image is: a block is only taken whole there)."""
        rest = rest[: self.block_tokens]
        if not rest or in_block(images, at, at + len(rest)):
            return None
        best, most = None, 0
        for key in self._followers(parent):
            ids = self._ram[key][0].ids if key in self._ram else self._disk.ids(key) if self._disk else None
            n = common_prefix_length(ids or (), rest)
            if n > most:
                best, most = key, n
        block = None if best is None else self._get(best, parent, seed, whole=False)
        if block is None or block.images or len(block.ids) != block.tokens or block.tokens > self.block_tokens:
            return None
        return block.head(most) if not found or fits(block, found[0]) else None

    def _followers(self, parent: str) -> list[str]:
        """The most recent blocks known to follow ``parent`` (RAM and folder), at most 16."""
        keys = self._children.get(parent, [])[-16:]  # (a slice: the cost does not grow with the cache)
        if self._disk is not None:
            keys = keys + [k for k in self._disk.children.get(parent, [])[-16:] if k not in self._ram]
        return keys[-16:]

    def _get(self, key: str, parent: str, seed: str, whole: bool = True) -> Block | None:
        entry = self._ram.get(key)
        if entry is not None:
            self._ram.move_to_end(key)
            return entry[0]
        if self._disk is None or not self._disk.has(key, parent):
            return None
        block = self._disk.read(key, seed, self.block_tokens if whole else None)
        if block is not None:
            self._keep(key, parent, block)
        return block

    def store(self, seed: str, tokens: Sequence[int], images: Sequence[ImageSpan], layers: Sequence[Any]) -> int:
        """Keep the blocks of ``tokens`` (the first positions of ``layers``) that are not cached yet, the
        last one partial; how many were new. Layers that are not plain or quantized KV alike are not kept."""
        if kind_of(layers) is None or not tokens:
            return 0
        new, parent, size = 0, seed, self.block_tokens
        with self._lock:
            for i, key in enumerate(chain(seed, tokens, images, size)):
                start, previous, parent = i * size, parent, key
                if key in self._ram:
                    self._ram.move_to_end(key)
                    continue
                on_disk = self._disk is not None and self._disk.has(key, previous)
                ids = tokens[start : start + size]
                block = take(layers, start, start + size, ids, bool(in_block(images, start, start + size)))
                self._keep(key, previous, block)
                if self._disk is not None and not on_disk:
                    self._disk.write(key, previous, seed, block)
                new += 1
            new += self._store_tail(seed, parent, tokens, images, layers)
        return new

    def _store_tail(self, seed: str, parent: str, tokens: Sequence[int], images: Sequence[ImageSpan],
                    layers: Sequence[Any]) -> int:
        """The partial block after the last whole one (so that a prompt that shares only part of it reuses
        that part); shorter partial blocks of the same start, which it covers, are dropped."""
        start = len(tokens) // self.block_tokens * self.block_tokens
        ids = tuple(tokens[start:])
        key = tail_key(parent, ids)
        if not ids or key in self._ram or (self._disk is not None and self._disk.has(key, parent)):
            return 0
        for other in self._children.get(parent, [])[-16:]:
            held = self._ram[other][0].ids
            if len(held) < len(ids) and ids[: len(held)] == held:
                self._drop(other)
        block = take(layers, start, len(tokens), ids, bool(in_block(images, start, len(tokens))))
        self._keep(key, parent, block)
        if self._disk is not None:
            self._disk.write(key, parent, seed, block)
        return 1

    def _drop(self, key: str) -> None:
        """Out of both tiers (a partial block another one covers)."""
        block, parent = self._ram.pop(key)
        self._ram_bytes -= block.nbytes
        self._children[parent].remove(key)
        if self._disk is not None:
            self._disk.remove(key)

    def _keep(self, key: str, parent: str, block: Block) -> None:
        """Into the RAM tier (the least recently used blocks out until it fits; not at all if it cannot)."""
        if block.nbytes > self.ram_max:
            return
        while self._ram and self._ram_bytes + block.nbytes > self.ram_max:
            old_key, (old, old_parent) = self._ram.popitem(last=False)
            self._ram_bytes -= old.nbytes
            self._ram_evictions += 1
            siblings = self._children.get(old_parent, [])
            if old_key in siblings:
                siblings.remove(old_key)
                if not siblings:
                    del self._children[old_parent]
        self._ram[key] = (block, parent)
        self._ram_bytes += block.nbytes
        self._children.setdefault(parent, []).append(key)


@dataclass(frozen=True)
class SharedPrefixes:
    """A prompt cache bound to one seed: what a session's cache state uses."""

    cache: PromptCache
    seed: str

    def fetch(self, prompt: Sequence[int], images: Sequence[ImageSpan] = (), have: int = 0) -> tuple[int, list[Any]] | None:
        return self.cache.lookup(self.seed, prompt, images, have)

    def insert(self, tokens: Sequence[int], layers: Sequence[Any], images: Sequence[ImageSpan] = ()) -> None:
        self.cache.store(self.seed, tokens, images, layers)


_DEFAULTS: weakref.WeakKeyDictionary[Any, PromptCache] = weakref.WeakKeyDictionary()
_DEFAULTS_LOCK = threading.Lock()


def default_prompt_cache(owner: Any) -> PromptCache | None:
    """The process-wide prompt cache of ``owner`` (a loaded model): RAM only, the default budget; ``None``
    when ``$CHATKIT_PROMPT_CACHE`` is ``off`` (sessions then use one only when given one)."""
    if os.environ.get("CHATKIT_PROMPT_CACHE", "").strip().lower() in ("off", "0", "false", "no"):
        return None
    with _DEFAULTS_LOCK:
        found = _DEFAULTS.get(owner)
        if found is None:
            found = _DEFAULTS[owner] = PromptCache()
        return found


__all__ = ["BLOCK_TOKENS", "PromptCache", "PromptCacheUsage", "SharedPrefixes", "default_prompt_cache", "default_ram_bytes"]
