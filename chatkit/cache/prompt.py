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
from .blocks import Block, chain, fits, join, kind_of, seed_of, take

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
        self._ram: OrderedDict[str, Block] = OrderedDict()
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
            self._ram_bytes = 0
            if self._disk is not None:
                self._disk.clear()

    def bind(self, parts: Mapping[str, Any]) -> SharedPrefixes:
        """This cache for KV shaped by ``parts`` (model fingerprint, adapter, KV quantization...)."""
        return SharedPrefixes(self, seed_of({**parts, "block_tokens": self.block_tokens}))

    def lookup(self, seed: str, prompt: Sequence[int], images: Sequence[ImageSpan], have: int) -> tuple[int, list[Any]] | None:
        """The longest run of cached blocks that starts ``prompt`` and leaves at least one token to feed,
        when it is longer than ``have``: (its length, new cache layers holding it)."""
        usable = (len(prompt) - 1) // self.block_tokens * self.block_tokens
        if usable <= have:
            return None
        found: list[Block] = []
        with self._lock:
            for key in chain(seed, prompt[:usable], images, self.block_tokens):
                block = self._get(key, seed)
                if block is None or (found and not fits(block, found[0])):
                    self._misses += 1
                    break
                found.append(block)
            n = len(found) * self.block_tokens
            if n <= have:
                return None
            self._hits += len(found)
        return n, join(found)

    def _get(self, key: str, seed: str) -> Block | None:
        block = self._ram.get(key)
        if block is not None:
            self._ram.move_to_end(key)
            return block
        if self._disk is None or not self._disk.has(key):
            return None
        block = self._disk.read(key, seed, self.block_tokens)
        if block is not None:
            self._keep(key, block)
        return block

    def store(self, seed: str, tokens: Sequence[int], images: Sequence[ImageSpan], layers: Sequence[Any]) -> int:
        """Keep the full blocks of ``tokens`` (the first positions of ``layers``) that are not cached yet;
        how many were new. Layers that are not plain or quantized KV alike are not kept."""
        if kind_of(layers) is None or len(tokens) < self.block_tokens:
            return 0
        new = 0
        with self._lock:
            for i, key in enumerate(chain(seed, tokens, images, self.block_tokens)):
                if key in self._ram:
                    self._ram.move_to_end(key)
                    continue
                on_disk = self._disk is not None and self._disk.has(key)
                block = take(layers, i * self.block_tokens, (i + 1) * self.block_tokens)
                self._keep(key, block)
                if self._disk is not None and not on_disk:
                    self._disk.write(key, seed, block)
                new += 1
        return new

    def _keep(self, key: str, block: Block) -> None:
        """Into the RAM tier (the least recently used blocks out until it fits; not at all if it cannot)."""
        if block.nbytes > self.ram_max:
            return
        while self._ram and self._ram_bytes + block.nbytes > self.ram_max:
            _, old = self._ram.popitem(last=False)
            self._ram_bytes -= old.nbytes
            self._ram_evictions += 1
        self._ram[key] = block
        self._ram_bytes += block.nbytes


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


def default_prompt_cache(owner: Any) -> PromptCache:
    """The process-wide prompt cache of ``owner`` (a loaded model): RAM only, the default budget."""
    with _DEFAULTS_LOCK:
        found = _DEFAULTS.get(owner)
        if found is None:
            found = _DEFAULTS[owner] = PromptCache()
        return found


__all__ = ["BLOCK_TOKENS", "PromptCache", "PromptCacheUsage", "SharedPrefixes", "default_prompt_cache", "default_ram_bytes"]
