"""The prompt cache's disk tier: one safetensors file per block in a folder, within a byte budget.

A block file is named ``<parent key>.<key>`` (the parent: the key of the block before it, or the seed),
so that the blocks that follow a given one are known from the folder's listing alone; it is written atomically (``atomic.write``: a killed writer leaves only a stale temporary
file, removed at the next start), names its key and seed in its metadata with an XXH3-128 checksum of its arrays,
and is read only after its header is checked (``header.read_header``). A file that is damaged,
truncated, foreign (another key or seed) or of another shape is deleted and reported as a miss: it is
never served and never an error. The least recently used files go first when the folder is over its
budget (use refreshes a file's modification time, so the order survives a restart).
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import xxhash

from ..errors import CacheFileError
from .atomic import remove_stale_temps, write
from .blocks import PLAIN, QUANTIZED, Block
from .header import read_header

SUFFIX = ".kvblock.safetensors"
_META = "chatkit_prompt_block"
_VERSION = 2  # 1: SHA-256 checksums (its files are skipped as foreign and recomputed)


def digest(arrays: dict[str, mx.array]) -> str:
    """XXH3-128 over the arrays' names, dtypes, shapes and bytes (in name order). It guards against damage
    (torn writes, bit rot, truncation), not tampering: the folder is the user's own, as for SQLite's
    checksums. XXH3 checks a 2k-token prompt's 32 MB of blocks in ~3 ms here (SHA-256: ~24 ms)."""
    h = xxhash.xxh3_128()
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}|{a.dtype}|{list(a.shape)}|".encode())
        h.update(memoryview(a))  # type: ignore[arg-type]  # mx.array has the buffer protocol (no copy)
    return h.hexdigest()


def _arrays(block: Block) -> dict[str, mx.array]:
    return {f"{i}.{j}": a for i, arrays in enumerate(block.layers) for j, a in enumerate(arrays)}


class BlockFiles:
    """The block files of one folder: an index (key -> bytes, least recently used first) and a budget."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        self.evictions = 0
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheFileError(f"Cannot use {str(folder)!r} as a prompt-cache folder: {exc.strerror or exc}.") from exc
        if not os.access(folder, os.W_OK):
            raise CacheFileError(f"The prompt-cache folder {str(folder)!r} is not writable: choose another.")
        remove_stale_temps(folder)  # the leftovers of writers that were killed
        self._index: OrderedDict[str, tuple[int, str]] = OrderedDict()  # key -> (bytes, parent key)
        self.children: dict[str, list[str]] = {}  # parent key -> keys of the files that follow it
        found = []
        for entry in os.scandir(folder):
            parent, _, key = entry.name[: -len(SUFFIX)].partition(".")
            if entry.name.endswith(SUFFIX) and key and entry.is_file(follow_symlinks=False):
                stat = entry.stat()
                found.append((stat.st_mtime, key, parent, stat.st_size))
        self.nbytes = 0
        for _, key, parent, size in sorted(found):
            self._add(key, parent, size)
        self._evict(0)

    def _add(self, key: str, parent: str, size: int) -> None:
        self._index[key] = (size, parent)
        self.children.setdefault(parent, []).append(key)
        self.nbytes += size

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[str]:
        return list(self._index)

    def path(self, parent: str, key: str) -> Path:
        return self.folder / f"{parent}.{key}{SUFFIX}"

    def has(self, key: str, parent: str) -> bool:
        """Whether a file of ``key`` is there (one another process wrote included)."""
        if key in self._index:
            return True
        try:
            size = self.path(parent, key).stat().st_size
        except OSError:
            return False
        self._add(key, parent, size)
        return True

    def ids(self, key: str) -> tuple[int, ...] | None:
        """The token ids of the block of ``key``, from its header only (``None``: unreadable)."""
        entry = self._index.get(key)
        try:
            meta = json.loads(read_header(self.path(entry[1], key))[0].get(_META, "null")) if entry else None
            ids = meta.get("ids") if isinstance(meta, dict) else None
        except (CacheFileError, OSError, ValueError):
            return None
        return tuple(ids) if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else None

    def read(self, key: str, seed: str, tokens: int | None) -> Block | None:
        """The block of ``key`` if its file is whole and this chain's; else ``None`` (the file is removed)."""
        opened = self._open(key, seed, tokens)
        return self._checked(key, opened, opened is not None and digest(opened[1]) == opened[2])

    def read_many(self, keys: Sequence[str], seed: str, tokens: int) -> list[Block]:
        """The whole blocks of ``keys`` in order, up to the first missing or damaged one (removed)."""
        blocks: list[Block] = []
        for key in keys:
            block = self.read(key, seed, tokens)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _checked(self, key: str, opened: tuple[Block, dict[str, mx.array], Any] | None, ok: bool) -> Block | None:
        """``opened``'s block when ``ok`` (its file marked as just used); else ``None``, the file removed."""
        if opened is None or not ok:
            self.remove(key)
            return None
        self._index.move_to_end(key)
        try:
            os.utime(self.path(self._index[key][1], key))
        except OSError:
            pass
        return opened[0]

    def _open(self, key: str, seed: str, most: int | None) -> tuple[Block, dict[str, mx.array], Any] | None:
        """The block of ``key``'s file, its arrays (read) and the checksum its header gives, when the file
        is there and says it is this chain's block; ``None`` when not."""
        if key not in self._index:
            return None
        try:
            return self._load(self.path(self._index[key][1], key), key, seed, most)
        except (CacheFileError, OSError, ValueError, RuntimeError, KeyError, TypeError):
            return None

    def _load(self, path: Path, key: str, seed: str, most: int | None) -> tuple[Block, dict[str, mx.array], Any] | None:
        metadata, _, _ = read_header(path)  # before MLX reads anything
        meta = json.loads(metadata.get(_META, "null"))
        if not isinstance(meta, dict) or meta.get("version") != _VERSION or meta.get("key") != key:
            return None
        tokens = meta.get("tokens")
        if meta.get("seed") != seed or meta.get("kind") not in (PLAIN, QUANTIZED) or not isinstance(tokens, int):
            return None
        if tokens < 1 or (most is not None and tokens != most):
            return None
        layers, per_layer = meta.get("layers"), 6 if meta["kind"] == QUANTIZED else 2
        loaded = mx.load(str(path))
        assert isinstance(loaded, dict)
        if not isinstance(layers, int) or set(loaded) != {f"{i}.{j}" for i in range(layers) for j in range(per_layer)}:
            return None
        if any(a.ndim < 2 or a.shape[-2] != tokens for a in loaded.values()):
            return None
        ids = meta.get("ids")
        if not isinstance(ids, list) or len(ids) != tokens or not all(isinstance(i, int) for i in ids):
            return None
        mx.eval(list(loaded.values()))  # read before the checksum looks at the bytes
        arrays = tuple(tuple(loaded[f"{i}.{j}"] for j in range(per_layer)) for i in range(layers))
        block = Block(meta["kind"], arrays, tokens, int(meta.get("bits", 0)), int(meta.get("group", 0)), tuple(ids),
                      bool(meta.get("images")))
        return block, loaded, meta.get("xxh3")


    def write(self, key: str, parent: str, seed: str, block: Block) -> None:
        """Store ``block`` (skipped when it alone exceeds the budget or the disk refuses: only a saving)."""
        if self.has(key, parent) or block.nbytes > self.max_bytes:
            return
        arrays = _arrays(block)
        meta = {"version": _VERSION, "key": key, "seed": seed, "tokens": block.tokens, "kind": block.kind,
                "bits": block.bits, "group": block.group, "layers": len(block.layers), "xxh3": digest(arrays),
                "ids": list(block.ids), "images": block.images, "written": time.time()}
        try:
            size = write(self.path(parent, key), "a prompt-cache block",
                         lambda tmp: mx.save_safetensors(tmp, arrays, metadata={_META: json.dumps(meta)}))
        except CacheFileError:
            return
        self._evict(size)
        self._add(key, parent, size)

    def _evict(self, incoming: int) -> None:
        while self._index and self.nbytes + incoming > self.max_bytes:
            key = next(iter(self._index))
            self.remove(key)
            self.evictions += 1

    def remove(self, key: str) -> None:
        size, parent = self._index.pop(key, (0, ""))
        self.nbytes -= size
        siblings = self.children.get(parent, [])
        if key in siblings:
            siblings.remove(key)
            if not siblings:
                del self.children[parent]
        try:
            self.path(parent, key).unlink()
        except OSError:
            pass

    def clear(self) -> None:
        """Every block file of the folder gone (those another process wrote too)."""
        for key in list(self._index):
            self.remove(key)
        try:
            for entry in os.scandir(self.folder):
                if entry.name.endswith(SUFFIX):
                    os.unlink(entry.path)
        except OSError:
            pass


__all__ = ["SUFFIX", "BlockFiles", "digest"]
