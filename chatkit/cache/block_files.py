"""The prompt cache's disk tier: one safetensors file per block in a folder, within a byte budget.

A block file is written atomically (``atomic.write``: a killed writer leaves only a stale temporary
file, removed at the next start), names its key and seed in its metadata with a SHA-256 of its arrays,
and is read only after its header is checked (``header.read_header``). A file that is damaged,
truncated, foreign (another key or seed) or of another shape is deleted and reported as a miss: it is
never served and never an error. The least recently used files go first when the folder is over its
budget (use refreshes a file's modification time, so the order survives a restart).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import OrderedDict
from pathlib import Path

import mlx.core as mx

from ..errors import CacheFileError
from .atomic import remove_stale_temps, write
from .blocks import PLAIN, QUANTIZED, Block
from .header import read_header

SUFFIX = ".kvblock.safetensors"
_META = "chatkit_prompt_block"
_VERSION = 1


def digest(arrays: dict[str, mx.array]) -> str:
    """SHA-256 over the arrays' names, dtypes, shapes and bytes (in name order)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}|{a.dtype}|{list(a.shape)}|".encode())
        h.update(bytes(memoryview(a)))  # type: ignore[arg-type]  # mx.array has the buffer protocol
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
        self._index: OrderedDict[str, int] = OrderedDict()
        found = []
        for entry in os.scandir(folder):
            if entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                stat = entry.stat()
                found.append((stat.st_mtime, entry.name[: -len(SUFFIX)], stat.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
        self.nbytes = sum(self._index.values())
        self._evict(0)

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[str]:
        return list(self._index)

    def _path(self, key: str) -> Path:
        return self.folder / (key + SUFFIX)

    def has(self, key: str) -> bool:
        """Whether a file of ``key`` is there (one another process wrote included)."""
        if key in self._index:
            return True
        try:
            size = self._path(key).stat().st_size
        except OSError:
            return False
        self._index[key] = size
        self.nbytes += size
        return True

    def read(self, key: str, seed: str, tokens: int) -> Block | None:
        """The block of ``key`` if its file is whole and this chain's; else ``None`` (the file is removed)."""
        path = self._path(key)
        try:
            block = self._load(path, key, seed, tokens)
        except (CacheFileError, OSError, ValueError, RuntimeError, KeyError, TypeError):
            block = None
        if block is None:
            self.remove(key)
            return None
        self._index.move_to_end(key)
        try:
            os.utime(path)
        except OSError:
            pass
        return block

    def _load(self, path: Path, key: str, seed: str, tokens: int) -> Block | None:
        metadata, _, _ = read_header(path)  # before MLX reads anything
        meta = json.loads(metadata.get(_META, "null"))
        if not isinstance(meta, dict) or meta.get("version") != _VERSION or meta.get("key") != key:
            return None
        if meta.get("seed") != seed or meta.get("tokens") != tokens or meta.get("kind") not in (PLAIN, QUANTIZED):
            return None
        layers, per_layer = meta.get("layers"), 6 if meta["kind"] == QUANTIZED else 2
        loaded = mx.load(str(path))
        assert isinstance(loaded, dict)
        if not isinstance(layers, int) or set(loaded) != {f"{i}.{j}" for i in range(layers) for j in range(per_layer)}:
            return None
        if any(a.ndim < 2 or a.shape[-2] != tokens for a in loaded.values()) or digest(loaded) != meta.get("sha256"):
            return None
        arrays = tuple(tuple(loaded[f"{i}.{j}"] for j in range(per_layer)) for i in range(layers))
        return Block(meta["kind"], arrays, tokens, int(meta.get("bits", 0)), int(meta.get("group", 0)))

    def write(self, key: str, seed: str, block: Block) -> None:
        """Store ``block`` (skipped when it alone exceeds the budget or the disk refuses: only a saving)."""
        if self.has(key) or block.nbytes > self.max_bytes:
            return
        arrays = _arrays(block)
        meta = {"version": _VERSION, "key": key, "seed": seed, "tokens": block.tokens, "kind": block.kind,
                "bits": block.bits, "group": block.group, "layers": len(block.layers), "sha256": digest(arrays),
                "written": time.time()}
        try:
            size = write(self._path(key), "a prompt-cache block",
                         lambda tmp: mx.save_safetensors(tmp, arrays, metadata={_META: json.dumps(meta)}))
        except CacheFileError:
            return
        self._evict(size)
        self._index[key] = size
        self.nbytes += size

    def _evict(self, incoming: int) -> None:
        while self._index and self.nbytes + incoming > self.max_bytes:
            key = next(iter(self._index))
            self.remove(key)
            self.evictions += 1

    def remove(self, key: str) -> None:
        self.nbytes -= self._index.pop(key, 0)
        try:
            self._path(key).unlink()
        except OSError:
            pass

    def clear(self) -> None:
        for key in list(self._index):
            self.remove(key)


__all__ = ["SUFFIX", "BlockFiles", "digest"]
